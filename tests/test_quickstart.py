"""The README quick start runs exactly as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quick_start_runs_as_written() -> None:
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    quick = [b for b in blocks if "rf.Receiver(" in b and "anyio.run(main)" in b]
    assert quick, "README has no quick-start block"
    namespace: dict = {"__name__": "__quickstart__"}
    exec(compile(quick[0], str(README), "exec"), namespace)  # raises if any assert in it fails
    assert "main" in namespace
