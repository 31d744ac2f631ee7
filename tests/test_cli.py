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


def test_every_option_has_a_meaning_and_a_default_stated_once():
    import re

    from attnzoo.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        text = " ".join(sub.format_help().split())
        assert not re.search(r"\(default: (None|\[\]|False|)\)", text), name
        assert not re.search(r"\(default: [^)]*\) \(default:", text), name
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings}: no help"
    forecast = " ".join(commands["forecast"].format_help().split())
    assert "horizon: steps to forecast (default: 24)" in forecast
    assert "training batches per epoch (default: all) --max-rows" in forecast
    assert "torch threads (0: as many as torch picks) (default: 0)" in forecast  # 0 is not "nothing"
