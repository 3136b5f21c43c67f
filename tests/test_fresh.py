"""The tests' runs as a user starts them: forked from the pre-imported zygote in make test, fresh interpreters with
their own hash salt in make test-all's second pass (WAPSTABLE_TEST_FRESH=1)."""

import sys

from conftest import FRESH, python_run


def test_runs_are_fresh_processes_in_the_fresh_pass(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nprint(hash('wapstable'), 'torch' in sys.modules)\n")
    a = python_run([sys.executable, str(probe)]).stdout.split()
    b = python_run([sys.executable, str(probe)]).stdout.split()
    if FRESH:  # each its own interpreter and hash salt: nothing imported before the script
        assert a[0] != b[0] and a[1] == b[1] == "False"
    else:  # forked from the zygote: one salt, torch imported already
        assert a[0] == b[0] and a[1] == b[1] == "True"
