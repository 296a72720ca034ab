"""Bus bandwidth against message size, drawn from pyddp.bench's results.

``python -m pyddp.bench ... --plot FILE.png`` calls ``plot`` on rank 0 after the run;
``python -m pyddp.bench_plot RESULTS.json FILE.png`` draws the same figure again from a
file that ``--json`` saved, without rerunning anything. One panel per collective
measured, message size on a log-2 axis, busbw (GB/s, nccl-tests' definition) against
it, one line per variant in the run: pyddp (its own algorithm choice: hierarchical
from PYDDP_HIER_MIN_BYTES up when the group spans hosts and some host has several
ranks), the flat ring forced (``--compare-flat``) and torch's gloo
(``--compare-gloo``); across hosts with ``--tcp-stream``, a dashed line at the busbw the
host links allow. The title gives world size and hosts.

matplotlib is not a dependency of pyddp: it is the ``plot`` extra, imported here only
when a figure is drawn (``missing_matplotlib`` says what to install when it is absent).
"""
import argparse
import json
import sys

INSTALL_HINT = ("plotting (pyddp.bench --plot, pyddp.bench_plot) needs matplotlib, which is "
                'not installed: pip install "pyddp[plot]" (from a checkout: '
                'pip install -e ".[plot]")')
STYLE = {"pyddp": ("C0", "o", "-"), "flat": ("C2", "s", "-"), "gloo": ("C1", "^", "--")}


def missing_matplotlib():
    """None when matplotlib imports, else the message that names the extra to install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


def size_label(n):
    """8 -> '8B', 65536 -> '64K', 1 << 26 -> '64M' (binary units, as pyddp.bench's -b/-e)."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def variant_label(variant, info):
    """The legend's name for one timed variant of the run described by info."""
    if variant == "gloo":
        return "torch gloo"
    if variant == "flat":
        return "pyddp, flat ring forced"
    algo = info.get("algo", "auto")
    layered = info["hosts"] > 1 and info["world"] > info["hosts"]
    if algo == "auto" and layered:
        return f"pyddp (hierarchical from {size_label(info.get('hier_min_bytes', 1 << 20))})"
    if algo != "auto":
        return f"pyddp (PYDDP_ALGO={algo})"
    return "pyddp"


def title(info, note=None):
    """Two lines: world size and hosts, dtype, op and rounds; the machine, and note."""
    w, h = info["world"], info["hosts"]
    layout = (f"{w} ranks on one host" if h == 1 else
              f"{w} ranks: {h} hosts x {w // h} ranks" if w % h == 0 else f"{w} ranks on {h} hosts")
    runs = info.get("runs", 1)    # benchmarks/plots.py: the median of several runs
    first = (f"{layout}; {info['dtype']} {info['op']}, median of {info['rounds']} rounds"
             + (f", median of {runs} runs" if runs > 1 else ""))
    second = [f"{info['cpus']} CPUs", f"shm {info['shm']}"]
    if info.get("stream_gbps"):
        second.append(f"one TCP stream {info['stream_gbps']:.3f} GB/s")
    if note:
        second.append(note)
    return first + "\n" + ", ".join(second)


def plot(results, path, note=None):
    """Draw results (pyddp.bench's --json contents: its run_info keys plus "rows") to the
    PNG file path; note (default: results' "note", which a script that ran the bench may
    have added, e.g. the link's cap), if any, is added to the title's second line. Raises
    SystemExit with INSTALL_HINT when matplotlib is missing."""
    problem = missing_matplotlib()
    if problem:
        raise SystemExit(problem)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = results["rows"]
    ops = list(dict.fromkeys(r["collective"] for r in rows))
    ncols = 1 if len(ops) == 1 else 2
    nrows = (len(ops) + ncols - 1) // ncols
    fig = Figure(figsize=(5.2 * ncols, 3.4 * nrows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, op in zip(axes, ops):
        mine = [r for r in rows if r["collective"] == op]
        sizes = [r["size"] for r in mine]
        for variant in results["backends"]:
            color, marker, line = STYLE.get(variant, (None, "x", "-"))
            ax.plot(sizes, [r["backends"][variant]["busbw"] for r in mine], color=color,
                    marker=marker, linestyle=line, markersize=3.5, linewidth=1.4,
                    label=variant_label(variant, results))
        bounds = [r["bound"] for r in mine if "bound" in r]
        if bounds:
            ax.axhline(max(bounds), color="0.45", linestyle=":", linewidth=1.2,
                       label="bound: host links at one TCP stream's rate")
        ax.set_xscale("log", base=2)
        ticks = sizes[::max(1, (len(sizes) + 5) // 6)]
        ax.set_xticks(ticks, [size_label(s) for s in ticks])
        ax.minorticks_off()
        # headroom above the highest line (or the bound) for the legend
        top = max([r["backends"][v]["busbw"] for r in mine for v in results["backends"]]
                  + bounds)
        ax.set_ylim(0, top * 1.45 if top > 0 else 1)
        ax.set_title(op, fontsize=10)
        ax.set_xlabel("message size (bytes)", fontsize=9)
        ax.set_ylabel("bus bandwidth (GB/s)", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    for ax in axes[len(ops):]:
        ax.set_visible(False)
    fig.suptitle(title(results, note or results.get("note")), fontsize=10)
    fig.savefig(path, format="png", dpi=90)


def main(argv=None):
    """python -m pyddp.bench_plot RESULTS.json FILE.png [--note TEXT]"""
    ap = argparse.ArgumentParser(prog="python -m pyddp.bench_plot",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a file written by python -m pyddp.bench --json")
    ap.add_argument("png", help="the figure to write")
    ap.add_argument("--note", default=None, help="added to the title (e.g. the link's cap)")
    a = ap.parse_args(argv)
    with open(a.results) as f:
        plot(json.load(f), a.png, note=a.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
