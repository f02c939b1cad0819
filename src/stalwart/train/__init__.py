"""Trainer loop, optimizer/schedule, data-parallel wrappers and local worker spawning."""
