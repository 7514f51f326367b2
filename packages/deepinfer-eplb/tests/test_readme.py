"""The package README's Python examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run(capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "[[ 5  6  5  7  8  4  3  4 10  9 10  2  0  1 11  1]" in out
    assert "(1, 2, 3, 4, 5, 6, 7)" in out
