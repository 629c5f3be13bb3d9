"""Decode tokens/s against decode steps per dispatch: the host loop's cost per token, measured.

`kvjax.generate` runs `steps_per_dispatch` decode steps (append, sample, EOS test) per call to the device
(`kvjax.engine.decode_loop`). With 1 the host waits for every token, as a per-step loop does; with K it waits
once per K tokens. For each model (the shipped tiny model, and SmolLM2-135M when fetched), batch size and
K: a prompt of `--prompt` tokens is prefilled (not timed), then `--new` tokens are generated greedily with
no EOS (`continue_rows`), timed after a warm-up run that compiles. Reported: decode tokens/s (all rows),
milliseconds per step, and the speed-up over K = 1 measured in the same run.

    python -m eval.bench_dispatch                  # writes ./kvjax-results/dispatch/bench_dispatch.{json,md,png}
    python -m eval.bench_dispatch --quick          # tiny model only, short
    kvjax bench dispatch --json
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np

from .lib.report import cpu_load, default_out, machine_info, markdown_table, write_outputs
from .lib.timing import timed

NO_EOS = -1  # a token id no model produces: every row runs the full length


def time_decode(model, prompts: np.ndarray, new_tokens: int, steps_per_dispatch: int, repeats: int) -> list[float]:
    """Seconds of `continue_rows` for `new_tokens` per row after a fresh prefill of `prompts`, per repeat
    (a warm-up run first)."""
    import kvjax
    from kvjax.engine.generation import continue_rows

    tails = [np.zeros(0, np.int32)] * len(prompts)
    seconds = []
    for r in range(repeats + 1):
        state, logits = kvjax.prefill(model, prompts, max_new_tokens=new_tokens)
        jax.block_until_ready(logits)
        out, elapsed, _ = timed(lambda: continue_rows(
            model, state, logits, tails, new_tokens, kvjax.make_policy("full"), eos_token_id=NO_EOS,
            steps_per_dispatch=steps_per_dispatch))
        assert (out >= 0).all(), "a row stopped early"
        if r:  # the first run compiles
            seconds.append(elapsed)
    return seconds


def plot(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["batch"]) for r in rows})
    ks = sorted({r["steps_per_dispatch"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(ks)
    for i, k in enumerate(ks):
        values = [next((r["speedup_vs_1"] for r in rows if (r["model"], r["batch"]) == g and r["steps_per_dispatch"] == k),
                       np.nan) for g in groups]
        ax.bar(np.arange(len(groups)) + i * width, values, width, label=f"{k} steps / dispatch")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(np.arange(len(groups)) + width * (len(ks) - 1) / 2, [f"{m}\nbatch {b}" for m, b in groups])
    ax.set_ylabel("decode tokens/s relative to 1 step per dispatch")
    ax.set_title("Decode steps per device call")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"],
                   help="models to time (a registered name that is not fetched is skipped)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dispatch", type=int, nargs="+", default=[1, 4, 16, 64], help="decode steps per dispatch")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="tokens generated per row")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=default_out("dispatch"))
    p.add_argument("--quick", action="store_true", help="tiny model, batch 1 and 2, K 1 and 8, 16 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.batches, args.dispatch, args.prompt, args.new, args.repeats = ["tiny"], [1, 2], [1, 8], 64, 16, 1
    import kvjax
    from kvjax.models import hub

    load_before = cpu_load()
    rows = []
    for name in args.models:
        if name != "tiny" and name in hub.REGISTRY and hub.cached_path(name) is None:
            print(f"skipping {name}: not fetched (kvjax fetch {name})", flush=True)
            continue
        model = kvjax.load_model(name)
        rng = np.random.default_rng(0)
        for batch in args.batches:
            prompts = rng.integers(10, model.cfg.vocab_size, (batch, args.prompt)).astype(np.int32)
            steps = args.new - 1  # the first token comes from the prefill's logits
            times = {k: statistics.median(time_decode(model, prompts, args.new, k, args.repeats))
                     for k in sorted(args.dispatch)}
            for k, seconds in times.items():
                rows.append({"model": name, "batch": batch, "steps_per_dispatch": k, "seconds": seconds,
                             "ms_per_step": 1e3 * seconds / steps, "tokens_per_s": batch * args.new / seconds,
                             "speedup_vs_1": times[1] / seconds if 1 in times else None})
                print(rows[-1], flush=True)
        jax.clear_caches()
    payload = {"machine": machine_info(), "cpu_load_before": load_before, "cpu_load_after": cpu_load(),
               "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    headers = ["model", "batch", "steps / dispatch", "ms / step", "tokens/s", "vs 1 step / dispatch"]
    table = markdown_table(headers, [[r["model"], r["batch"], r["steps_per_dispatch"], round(r["ms_per_step"], 2),
                                      round(r["tokens_per_s"], 1),
                                      "" if r["speedup_vs_1"] is None else f"{r['speedup_vs_1']:.2f}x"] for r in rows])
    write_outputs(args.out, "bench_dispatch", payload, table)
    if rows and rows[0]["speedup_vs_1"] is not None:
        plot(rows, f"{args.out}/bench_dispatch.png")
    print(table)
    return payload


if __name__ == "__main__":
    main()
