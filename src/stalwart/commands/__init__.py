"""One module per `stalwart` subcommand; each exposes `register(subparsers)`.

Heavy imports (torch) happen inside the handlers so `stalwart --help` stays fast.
"""
