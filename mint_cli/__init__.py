"""`mint`, MinT's one command line: `main` parses and runs a command (mint_cli/main.py); the
options several commands share are declared once (options.py); each command group has a
module of its own (training, rollout, catalog, services). Child processes MinT starts (a
worker, a gateway, the flow server) run `python -m mint_cli <command>` too."""

from mint_cli.main import main, quiet_libraries

__all__ = ["main", "quiet_libraries"]
