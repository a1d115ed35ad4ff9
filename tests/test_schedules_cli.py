"""`fmoe schedule show/check`: timelines, figures, files written, one-line errors."""

from fmoe.schedules.cli import main, parse_costs
from fmoe.schedules.generators import generate
from fmoe.schedules.table import read_csv, write_csv
from fmoe.schedules.verify import lower


def test_show_prints_timeline_and_figures_and_writes_png_and_csv(tmp_path, capsys):
    png, csv = tmp_path / "dpv.png", tmp_path / "dpv.csv"
    argv = ["show", "dualpipev", "--pp", "4", "--microbatches", "10", "--costs", "f=1,b=1,w=1,fb=2"]
    assert main([*argv, "--png", str(png), "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    timeline = [ln for ln in out.splitlines() if ln.startswith("rank ") and "|" in ln]
    assert [ln.split("|")[0].strip() for ln in timeline] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert "F0" in timeline[0] and "f0" in timeline[0]  # chunk 1 in lower case
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:3] == ["rank", "busy", "idle"])
    idle = [float(ln.split()[2]) for ln in lines[head + 1 : head + 5]]
    # the largest idle time is the published DualPipeV bubble (PP/2-1)(F&B+B-3W), PP = 8: 3 * (2+2-3)
    assert max(idle) == 3
    assert "makespan 52, mean bubble" in out and "max peak activations 9" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_csv(csv) == generate("dualpipev", 4, 10)


def test_show_lowered_csv_and_check_it(tmp_path, capsys):
    csv = tmp_path / "zbv.csv"
    assert main(["show", "zbv", "--pp", "2", "--microbatches", "4", "--csv", str(csv), "--lowered"]) == 0
    assert read_csv(csv) == lower(generate("zbv", 2, 4))
    capsys.readouterr()
    assert main(["check", str(csv)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{csv}: valid") and "rank 1 |" in out


def test_check_rejects_a_broken_table_naming_the_row(tmp_path, capsys):
    text = write_csv(generate("1f1b", 2, 2)).replace("1,F,0,0\n1,BW,0,0\n", "1,BW,0,0\n1,F,0,0\n")
    path = tmp_path / "bad.csv"
    path.write_text(text)
    assert main(["check", str(path)]) == 2  # a bad table is bad input, as everywhere in fmoe
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("fmoe: error: invalid table: rank 1 row 0 (") and "line 7): BW(mb=0, chunk=0)" in err
    )
    assert len(err.splitlines()) == 1


def test_bad_input_gives_one_line_errors(tmp_path, capsys):
    binary = tmp_path / "weights.csv"
    binary.write_bytes(bytes(range(256)) * 4)
    cases = [
        (["show", "dualpipev", "--pp", "4", "--microbatches", "4"], "needs microbatches >= 2 * pp"),
        (["show", "nope", "--pp", "4", "--microbatches", "4"], "unknown schedule 'nope'"),
        (["show", "1f1b", "--pp", "x", "--microbatches", "4"], "argument --pp: invalid int value: 'x'"),
        (
            ["show", "1f1b", "--pp", "2", "--microbatches", "4", "--costs", "f=a"],
            "--costs: f='a' is not a number",
        ),
        (["check", str(tmp_path / "missing.csv")], "cannot read"),
        (["check", str(binary)], f"{binary}: not a UTF-8 text table"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ]
    for argv, message in cases:
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2, argv
        assert err.startswith("fmoe: error: ") and message in err and len(err.splitlines()) == 1, (argv, err)


def test_an_output_in_a_missing_folder_is_refused_before_any_output(tmp_path, capsys):
    show = ["show", "1f1b", "--pp", "2", "--microbatches", "4"]
    for flag in ("--png", "--csv"):
        path = tmp_path / "no-such-folder" / "out"
        assert main([*show, flag, str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == "", flag  # not the whole table first, then the error
        assert err.startswith(f"fmoe: error: {flag} {path}:") and len(err.splitlines()) == 1, err
        assert not path.parent.exists()


def test_help_returns_zero(capsys):
    assert main(["show", "--help"]) == 0
    assert "--microbatches" in capsys.readouterr().out


def test_parse_costs_per_stage():
    c = parse_costs("f=1/2, b=3, transfer=0.5")
    assert (c.f, c.b, c.w, c.transfer) == ((1.0, 2.0), 3.0, 1.0, 0.5)


def test_the_png_legend_sits_clear_of_the_axes_labels():
    # the legend below the timeline once covered the x label ("time") at some rank counts
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from fmoe.schedules.render import timeline_figure
    from fmoe.schedules.simulator import Costs, simulate

    for name, pp, microbatches in (("1f1b", 2, 4), ("dualpipev", 4, 8), ("zbv", 8, 16)):
        schedule = generate(name, pp, microbatches)
        fig = timeline_figure(schedule, simulate(schedule, Costs()))
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        (ax,) = fig.axes
        legends = [*fig.legends, *([ax.get_legend()] if ax.get_legend() else [])]
        assert len(legends) == 1, name
        legend = legends[0].get_window_extent(renderer)
        labels = [ax.xaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()]
        for text in labels:
            box = text.get_window_extent(renderer)
            assert not (text.get_text() and legend.overlaps(box)), (name, text.get_text())
        assert fig.bbox.contains(legend.x0, legend.y0) and fig.bbox.contains(legend.x1, legend.y1), name
