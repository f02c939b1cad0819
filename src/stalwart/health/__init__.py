"""Node health: log diagnosis rules (and, with its issue, burn-in and collective checks)."""
