import attnzoo
from attnzoo.cli import main


def test_list_prints_every_mechanism(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in attnzoo.mechanisms():
        assert name in out
    assert attnzoo.get("full").citation.split(",")[0] in out
