import attnzoo
from attnzoo.cli import main


def test_list_prints_every_mechanism(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in attnzoo.mechanisms():
        assert name in out
    assert attnzoo.get("full").citation.split(",")[0] in out


def test_lists_take_commas_spaces_or_both():
    from attnzoo.cli import _names, build_parser

    for argv in (["--mechanisms", "full,linear", "--lengths", "256,512"],
                 ["--mechanisms", "full", "linear", "--lengths", "256", "512"],
                 ["--mechanisms", "full,", "linear", "--lengths", "256", "512,"]):
        args = build_parser().parse_args(["bench", *argv])
        assert _names(args.mechanisms) == ["full", "linear"]
        assert [L for part in args.lengths for L in part] == [256, 512]
