"""`python -m kai_isolator.services.watcher`: the same as `kai-isolator watcher`, which loads no other service's command."""

from __future__ import annotations

import sys

from kai_isolator.services import cli

if __name__ == "__main__":
    cli.main(["watcher", *sys.argv[1:]])
