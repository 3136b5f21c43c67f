"""The command-line tools: each module's `main(argv)` returns an exit status and raises UserError for bad input;
`run()` is the console entry point (`wapstable-evaluate`, ...) that turns a UserError into one line and exit 2.
`scripts/*.py` in a checkout call the same functions."""
