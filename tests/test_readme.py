import re
from pathlib import Path

import attnzoo

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run_as_written():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_readme_table_lists_every_mechanism():
    text = README.read_text()
    for name in attnzoo.mechanisms():
        assert f"| `{name}` |" in text, f"README's mechanism table misses {name}"
