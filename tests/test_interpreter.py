"""The emulator's changes to Triton's interpreter (tridist/runtime/interpreter.py) still match the
installed Triton: every private part they patch, replace or call is there, with the source they
were written against."""
import warnings

import pytest
import triton

from tridist.runtime import interpreter
from tridist.runtime.errors import TridistError


def test_relied_on_parts_are_unchanged():
    """Fails when a new Triton changes what the emulator patches: check each changed part against
    what interpreter.py does with it, then put the new hashes into RELIED_ON (the message lists them)."""
    missing = [name for name in interpreter.RELIED_ON if interpreter.resolve(name) is None]
    assert not missing, f"Triton {triton.__version__} lacks {missing}"
    changed = {name: interpreter.source_hash(name) for name, digest in interpreter.RELIED_ON.items()
               if interpreter.source_hash(name) != digest}
    assert not changed, (f"Triton {triton.__version__} changed what tridist/runtime/interpreter.py relies on; once "
                         f"each is checked, its hash in RELIED_ON becomes: {changed}")


def test_the_installed_triton_is_the_tested_one():
    assert triton.__version__.startswith(interpreter.TESTED_TRITON + "."), \
        f"Triton {triton.__version__}: check the emulator's changes on it, then update TESTED_TRITON"


def test_untested_triton_version_warns(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match=r"Triton 9\.0\.0 is untested there: .*pip install -e '\.\[emulator\]', or 'triton==3\.6\.\*'"):
        interpreter.check_triton("9.0.0")
    monkeypatch.setenv("RANK", "1")  # said once per job, by its first rank
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        interpreter.check_triton("9.0.0")
        interpreter.check_triton(f"{interpreter.TESTED_TRITON}.7")


def test_missing_part_refuses_to_start():
    relied_on = {**interpreter.RELIED_ON, "triton.runtime.interpreter.InterpreterBuilder.gone": "0" * 16}
    with pytest.raises(TridistError, match=r"lacks triton\.runtime\.interpreter\.InterpreterBuilder\.gone: install"):
        interpreter.check_triton(triton.__version__, relied_on)


def test_info_lists_an_untested_triton_under_what_to_fix():
    from tridist.runtime.info import emulator_triton_fix

    assert "pip install -e '.[emulator]'" in emulator_triton_fix("9.0.0")
    assert emulator_triton_fix(f"{interpreter.TESTED_TRITON}.7") is None


def test_the_emulator_extra_pins_the_tested_triton():
    """A CPU install (`.[emulator]`, as the README says) brings the Triton the emulator was tested with."""
    import os

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["emulator"] == [f"triton=={interpreter.TESTED_TRITON}.*"]
