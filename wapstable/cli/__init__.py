"""The command-line tools: each module's `main(argv)` returns an exit status and raises UserError for bad input;
`run()` is the console entry point (`wapstable-evaluate`, ...) that turns a UserError into one line and exit 2.
`scripts/*.py` in a checkout call the same functions."""

import sys
from collections.abc import Callable

from wapstable.errors import UserError


def run_script(main: Callable[[], int]) -> None:
    """Exit with `main()`'s status; a UserError is one `error:` line on stderr and exit status 2."""
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
