"""Suite runs side by side: figures matched by (benchmark, name, config), as values, shares and ratios.

    kvjax bench compare runs/cpu runs/h100 --out runs/compare    # compare.{md,json}, shares.png, ratios.png
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from .lib.report import RUN_KIND, default_out, markdown_table

LOWER_IS_BETTER = {"ms", "s"}  # times; every other unit (tok/s, GB/s, x, share) is better higher


def load_run(path: str) -> dict:
    """A suite run from its folder or its run.json; ValueError naming `path` when it is not one."""
    file = os.path.join(path, "run.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"{path}: no suite run here (kvjax bench suite --out DIR writes DIR/run.json)")
    try:
        with open(file) as f:
            run = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file} is not a suite run: not JSON ({error})") from None
    if not isinstance(run, dict) or run.get("kind") != RUN_KIND:
        raise ValueError(f"{file} is not a suite run: no \"kind\": \"{RUN_KIND}\" (kvjax bench suite writes run.json)")
    for field in ("device", "large_read", "figures"):
        if field not in run:
            raise ValueError(f"{file} is not a complete suite run: it lacks {field!r}")
    if not run["large_read"].get("median_gbps"):
        raise ValueError(f"{file}: its large read has no median_gbps")
    run["path"] = file
    return run


def figure_key(fig: dict) -> tuple[str, str, str]:
    return fig["benchmark"], fig["name"], json.dumps(fig.get("config", {}), sort_keys=True)


def config_text(config: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items())


def match(runs: list[dict]) -> list[dict]:
    """One row per figure of any run, in first-seen order: unit, values, shares, ratios to the first run."""
    by_key: dict[tuple, dict[str, Any]] = {}
    for i, run in enumerate(runs):
        for fig in run["figures"]:
            row = by_key.setdefault(figure_key(fig), {
                "benchmark": fig["benchmark"], "name": fig["name"], "config": fig.get("config", {}),
                "unit": fig["unit"], "values": [None] * len(runs), "shares": [None] * len(runs)})
            row["values"][i] = fig["value"]
            row["shares"][i] = fig.get("share_of_large_read")
    rows = list(by_key.values())
    for row in rows:
        first = row["values"][0]
        row["ratio_to_first"] = [None if v is None or not first else v / first for v in row["values"]]
        first_share = row["shares"][0]
        row["share_ratio_to_first"] = [None if s is None or not first_share else s / first_share for s in row["shares"]]
        row["common"] = all(v is not None for v in row["values"])
        row["higher_is_better"] = row["unit"] not in LOWER_IS_BETTER
    return rows


DEVICE_FIGURE_UNITS = ("ms", "tok/s", "x")
# bench_decode's transformers side runs torch on the host's CPU in both runs: neither it nor kvjax's ratio to it
# says anything of the device
HOST_ONLY_FIGURES = ("transformers_", "decode_speedup", "prefill_speedup")


def device_against_host(runs: list[dict]) -> str:
    """Two `kvjax bench suite` runs of `kvjax bench device` (`[host CPU run.json, device run.json]`), `match`ed:
    every time, rate and speedup figure both recorded, the device's over the host's (bandwidths: compare/)."""
    host, device = runs
    rows = [[r["benchmark"], r["name"], config_text(r["config"]), r["unit"], f"{r['values'][0]:.3g}",
             f"{r['values'][1]:.3g}", f"{r['ratio_to_first'][1]:.2f}"] for r in match(runs)
            if r["common"] and r["unit"] in DEVICE_FIGURE_UNITS and not r["name"].endswith("speedup_vs_1_step")
            and not r["name"].startswith(HOST_ONLY_FIGURES)]
    name = f"{device['device']['device_kind']} x{device['device']['device_count']}"
    return (markdown_table(["member", "figure", "config", "unit", f"host CPU ({host['device']['cpu_count']} threads)",
                            name, "device / host"], rows) +
            f"\nThe `{device['settings']['preset']}` preset, float32, JAX {device['device']['jax']}; for ms, lower is "
            "faster; for tok/s and x, higher. `decode` compares kvjax with transformers, whose torch runs on the "
            "host's CPU in both runs: those figures are left out here. Large read (`jnp.sum`): host "
            f"{host['large_read']['gbps']:.0f} GB/s, device {device['large_read']['gbps']:.0f} GB/s.\n")


def run_label(run: dict, i: int) -> str:
    return run.get("label") or f"run {i + 1}"


def _fmt(x, percent: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:.1%}" if percent else f"{x:.3g}"


def runs_table(runs: list[dict]) -> str:
    headers = ["run", "file", "device", "platform", "jax / jaxlib", "CPU", "threads", "dtype", "large read GB/s",
               "preset"]
    rows = []
    for i, run in enumerate(runs):
        tag = run["device"]
        rows.append([run_label(run, i), run["path"], f"{tag.get('device_kind')} x{tag.get('device_count')}",
                     tag.get("platform"), f"{tag.get('jax')} / {tag.get('jaxlib')}", tag.get("cpu_model"),
                     tag.get("threads"), tag.get("dtype"), f"{run['large_read']['median_gbps']:.1f}",
                     run.get("settings", {}).get("preset", "")])
    return markdown_table(headers, rows)


def figures_table(runs: list[dict], rows: list[dict]) -> str:
    labels = [run_label(run, i) for i, run in enumerate(runs)]
    headers = ["benchmark", "figure", "config", "unit"]
    for label in labels:
        headers += [label, f"{label} share of large read"]
    headers += [f"{label} / {labels[0]}" for label in labels[1:]]
    body = []
    for row in rows:
        line = [row["benchmark"], row["name"], config_text(row["config"]), row["unit"]]
        for value, share in zip(row["values"], row["shares"]):
            line += [_fmt(value), _fmt(share, percent=True)]
        line += [_fmt(r) for r in row["ratio_to_first"][1:]]
        body.append(line)
    return markdown_table(headers, body)


def write_markdown(runs: list[dict], rows: list[dict], path: str) -> None:
    common = [r for r in rows if r["common"]]
    partial = [r for r in rows if not r["common"]]
    notes = [f"- {run_label(run, i)}: {run['note']}" for i, run in enumerate(runs) if run.get("note")]
    lines = ["# Suite runs side by side", "", runs_table(runs)]
    if notes:
        lines += ["Notes:", "", *notes, ""]
    lines += [
        "Shares are each figure's bandwidth over its own run's large read (jnp.sum over a buffer far past the "
        "caches, measured on that device in that run); they and the speedup ratios (x) compare across devices. "
        f"The last columns divide each run's value by {run_label(runs[0], 0)}'s: above 1 is faster for tok/s, "
        "GB/s and x, slower for ms and s.", "",
        f"## Figures in every run ({len(common)})", "", figures_table(runs, common)]
    if partial:
        lines += [f"## Figures in some runs only ({len(partial)})", "", figures_table(runs, partial)]
    for i, run in enumerate(runs):
        skipped = {n: m for n, m in run.get("members", {}).items() if m.get("status") != "ok"}
        for name, member in skipped.items():
            lines.append(f"- {run_label(run, i)}: {name} {member['status']}: {member.get('reason', '')}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _bar_panels(runs: list[dict], rows: list[dict], values_of, xlabel: str, path: str, log: bool,
                reference: float | None, skip_first: bool = False) -> None:
    """Horizontal grouped bars, one panel per benchmark, one bar per run, drawn from `reference` (or 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    shown = list(enumerate(runs))[1 if skip_first else 0:]

    benchmarks = list(dict.fromkeys(r["benchmark"] for r in rows))
    if not benchmarks:
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.text(0.5, 0.5, "no figure to plot", ha="center", va="center")
        ax.axis("off")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    counts = [sum(r["benchmark"] == b for r in rows) for b in benchmarks]
    height = min(60.0, 1.2 * len(benchmarks) + 0.22 * len(runs) * sum(counts))
    fig, axes = plt.subplots(len(benchmarks), 1, figsize=(10, max(3.0, height)), squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": counts})
    width = 0.8 / len(shown)
    base = reference if log else 0.0
    for ax, benchmark in zip(axes[:, 0], benchmarks):
        panel = [r for r in rows if r["benchmark"] == benchmark]
        y = np.arange(len(panel))
        for slot, (i, run) in enumerate(shown):
            vals = np.array([np.nan if values_of(r)[i] is None else values_of(r)[i] for r in panel], float)
            ax.barh(y + slot * width, vals - base, width, left=base, label=run_label(run, i))
        ax.set_yticks(y + width * (len(shown) - 1) / 2)
        ax.set_yticklabels([f"{r['name']} {config_text(r['config'])}" for r in panel], fontsize=6)
        ax.invert_yaxis()
        if log:
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if reference is not None:
            ax.axvline(reference, color="gray", ls="--", lw=0.8)
        ax.set_title(benchmark, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="kvjax bench compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (or their run.json), the first is the reference")
    parser.add_argument("--out", default=default_out("compare"))
    args = parser.parse_args(argv)
    runs = [load_run(path) for path in args.runs]
    rows = match(runs)
    os.makedirs(args.out, exist_ok=True)
    paths = {name: os.path.join(args.out, name) for name in ("compare.md", "compare.json", "shares.png", "ratios.png")}
    write_markdown(runs, rows, paths["compare.md"])
    common = [r for r in rows if r["common"]]
    _bar_panels(runs, [r for r in common if any(s is not None for s in r["shares"])], lambda r: r["shares"],
                "share of the run's own large read", paths["shares.png"], log=False, reference=1.0)
    _bar_panels(runs, common, lambda r: r["ratio_to_first"], f"value / {run_label(runs[0], 0)}'s value (log)",
                paths["ratios.png"], log=True, reference=1.0, skip_first=len(runs) > 1)
    result = {
        "runs": [{"label": run_label(run, i), "path": run["path"], "device": run["device"], "note": run.get("note"),
                  "large_read_gbps": run["large_read"]["median_gbps"], "settings": run.get("settings")}
                 for i, run in enumerate(runs)],
        "figures": rows, "common": len(common), "outputs": paths,
    }
    with open(paths["compare.json"], "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}/compare.{{md,json}}, shares.png, ratios.png: {len(common)} figures in every run, "
          f"{len(rows) - len(common)} in some")
    return result


if __name__ == "__main__":
    main()
