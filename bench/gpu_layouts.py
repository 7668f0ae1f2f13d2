"""The trainer's step on one GPU in its three layouts (trainer.layout), beside a bare loop, in one run.

    bash bench/gpu_layouts.sh                      # on a GPU machine: the whole measurement (~4 min on an H200)
    python3 bench/gpu_layouts.py [--shape 1.5b] [--steps 3] [--out DIR]
    python3 bench/gpu_layouts.py --docs DIR/gpu_layouts.md   # here: its table into docs/BENCHMARKS.md

The model: random weights of Qwen2.5-1.5B's shape (1.31 B parameters outside the embeddings) with the tiny model's
tokenizer, as ../shared/gpu-probe measured `harness sft` (0.55x the bare loop, MFU 0.176 on an H200). Two batches
of 16 chat records, tokenised as `harness sft` does (trainer/offline/chat_data.py):
(a) unshared: 16 records of ~3,070 tokens that share only a short system prompt (the probe's data);
(b) GRPO-shaped: 2 tasks x 8 answers of ~600 tokens under one ~2,000-token system prompt and the task (what a
    group of episodes looks like to the trainer).
Arms, on the same model, one after the other:
- bare: `model(input_ids).logits` -> cross-entropy -> backward -> AdamW under bf16 autocast, no FSDP, rows of
  3,072 tokens, as many tokens a step as batch (a) has (the probe's bare.py: the floor for the trainer);
- the trainer's own optimizer step (trainer/offline/loop.py `_step`, gradient clipping, AdamW) on the model
  `build_policy` makes (FSDP2, bf16 mixed precision), in each layout, layouts interleaved; one warm-up step each,
  then the median of `--steps`.
MFU counts 6 x (parameters outside the embeddings) x positions computed per second against the card's dense bf16
peak (`--peak-tflops`, known for H100/H200/A100). Goals (issue 35): packed >= 0.9x the bare loop's tokens/s on
(a), MFU >= 0.35, tree >= 3x faster than padded on (b).

Needs torch and transformers, plus duckdb and orjson (the trainer imports them): bench/gpu_layouts.sh installs
wheels carried in .gpu/whl (`bash bench/gpu_layouts.sh --fetch` downloads them here). `--shape tiny` runs the
whole script on the tiny model on a CPU in seconds (tests/trainer/test_gpu_layouts_bench.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = ("padded", "packed", "tree")
SHAPES = {"1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2),
          "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2),
          "tiny": {}}
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16
WORDS = "alpha beta gamma delta model token agent reward train proxy engine value step batch loss sample".split()
BATCH = 16


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Words (~2.2 tokens each with the tiny tokenizer) of each part of the records."""
    long_answer: int = 1400  # (a)
    system: int = 900  # (b)
    task: int = 40
    answer: int = 270
    micro_batch_tokens: int = 16384
    bare_row: int = 3072


def build_model(folder: Path, shape: str, device: str) -> Path:
    """The tiny model, or random weights of `shape` with its tokenizer (initialised on `device`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.running.tiny_model import build_tiny_model

    tiny = build_tiny_model(folder / "tiny")
    if shape == "tiny":
        return tiny
    out = folder / shape
    out.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    config.update(SHAPES[shape], max_position_embeddings=32768)
    for key in ("head_dim", "layer_types", "max_window_layers"):
        config.pop(key, None)
    for f in tiny.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    model.save_pretrained(out)
    return out


def records(sizes: Sizes) -> dict[str, list[dict]]:
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    unshared = [[{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Task {i}: write."},
                 {"role": "assistant", "content": words(sizes.long_answer)}] for i in range(BATCH)]
    system = "Rules. " + words(sizes.system)
    tasks = [f"Task {k}: " + words(sizes.task) for k in range(2)]
    grpo = [[{"role": "system", "content": system}, {"role": "user", "content": tasks[i // 8]},
             {"role": "assistant", "content": words(sizes.answer)}] for i in range(BATCH)]
    return {"(a) unshared, 16 records": [{"messages": m} for m in unshared],
            "(b) GRPO-shaped, 2 tasks x 8": [{"messages": m} for m in grpo]}


def non_embedding_parameters(model) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name
               and "lm_head" not in name)


def bare_loop(model_dir: Path, tokens: int, sizes: Sizes, steps: int, device) -> dict:
    """The probe's floor: a plain forward, cross-entropy, backward and AdamW step, rows of sizes.bare_row tokens,
    micro-batches of sizes.micro_batch_tokens, `tokens` a step."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    per_micro = max(sizes.micro_batch_tokens // sizes.bare_row, 1)
    rows = max(round(tokens / sizes.bare_row), 1)
    x = torch.randint(0, vocab, (rows, sizes.bare_row), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        for k in range(0, rows, per_micro):
            ids = x[k:k + per_micro]
            with autocast:
                logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = _timed(step, steps, device)
    result = {"tokens": rows * sizes.bare_row, "computed": rows * sizes.bare_row, "seconds": seconds,
              "peak_gib": _peak_gib(device), "parameters": non_embedding_parameters(model)}
    return result


def trainer_steps(model_dir: Path, batches: dict[str, list[dict]], sizes: Sizes, steps: int, folder: Path,
                  dist) -> dict[str, dict[str, dict]]:
    """harness sft's optimizer step over each batch in each layout, layouts interleaved."""
    from transformers import AutoTokenizer

    from trainer.config import load_config
    from trainer.maths import algorithms as algo
    from trainer.model.build import build_policy
    from trainer.offline.chat_data import chat_samples

    data = folder / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for rows in batches.values() for r in rows))
    config = folder / "sft.yaml"
    config.write_text(json.dumps({"harness": {"model": {"path": str(model_dir), "dtype": "auto"},
                                  "trainer": {"lr": 1e-5, "warmup_steps": 0, "save_freq": 0, "test_freq": 0,
                                              "micro_batch_tokens": sizes.micro_batch_tokens},
                                  "offline": {"data": str(data), "epochs": 1, "batch_size": BATCH,
                                              "max_length": 8192},
                                  "logging": {"run_dir": str(folder / "runs")}}}))
    cfg = load_config(config, mode="sft")
    built = build_policy(cfg, dist, total_steps=1000, mode="sft")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out: dict[str, dict[str, dict]] = {}
    for name, rows in batches.items():
        samples = chat_samples(rows, tokenizer, max_length=8192).samples
        weights = algo.token_weights(samples, cfg.trainer.loss_agg_mode)
        times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        metrics: dict[str, dict] = {}
        peaks: dict[str, float | None] = {}
        for repeat in range(steps + 1):  # the first is the warm-up
            for layout in LAYOUTS:
                laid = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, layout=layout))
                step = functools.partial(_sft_step, built, samples, weights, laid, dist, metrics, layout)
                seconds = _timed(step, 1, dist.device, warm=False)
                peaks[layout] = _peak_gib(dist.device)
                if repeat:
                    times[layout].append(seconds)
                print(f"{name} {layout} step {repeat}: {seconds:.2f} s", flush=True)
        out[name] = {layout: {"tokens": int(metrics[layout]["update/tokens"]),
                              "computed": int(metrics[layout]["update/tokens_computed"]),
                              "seconds": statistics.median(times[layout]),
                              "peak_gib": peaks[layout]} for layout in LAYOUTS}
    return out


def _sft_step(built, samples, weights, cfg, dist, metrics: dict, key: str) -> None:
    """One `harness sft` optimizer step (trainer/offline/loop.py) over `samples`; its metrics into metrics[key]."""
    import torch

    from trainer.offline.loop import _step

    metrics[key] = _step(built.model, samples, [1.0] * len(samples), weights, samples[0], built.pad_id, cfg, dist,
                         "sft")
    torch.nn.utils.clip_grad_norm_(built.model.parameters(), cfg.trainer.grad_clip or float("inf"))
    built.optimizer.step()
    built.optimizer.zero_grad(set_to_none=True)


def _timed(step, steps: int, device, warm: bool = True) -> float:
    import torch

    if warm:
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _free(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(bare: dict, results: dict[str, dict[str, dict]], card: str, peak_tflops: float | None, shape: str,
          steps: int, sizes: Sizes) -> str:
    import torch
    import transformers

    n = bare["parameters"]

    def mfu(r: dict) -> str:
        return f"{6 * n * r['computed'] / r['seconds'] / (peak_tflops * 1e12):.3f}" if peak_tflops else "-"

    def row(batch: str, arm: str, r: dict, padded: dict | None) -> str:
        faster = f"{padded['seconds'] / r['seconds']:.2f}x" if padded else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        return (f"| {batch} | {arm} | {r['tokens']:,} | {r['computed']:,} | {r['seconds']:.3f} | "
                f"{r['tokens'] / r['seconds']:,.0f} | {_speed(r, bare):.2f}x | {faster} | {mfu(r)} | {peak} |")

    lines = [row("(a)", "bare loop", bare, None)]
    for batch, by_layout in results.items():
        for layout, r in by_layout.items():
            lines.append(row(batch, layout, r, by_layout["padded"]))
    a, b = list(results.values())
    return "\n".join([
        "## The trainer's layouts on a GPU (bench/gpu_layouts.py)",
        "",
        f"{date.today()}, {card}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{platform.machine()}: random weights of {shape}'s shape ({n / 1e9:.2f} B parameters outside the "
        "embeddings, the tiny tokenizer), 16 chat records a step as `harness sft` tokenises them; the trainer's own "
        f"optimizer step (FSDP2 and its bf16 mixed precision, micro-batches of {sizes.micro_batch_tokens:,} "
        "positions) in each layout, "
        f"interleaved, median of {steps} after a warm-up; the bare loop: forward, cross-entropy, backward, AdamW "
        f"under bf16 autocast, no FSDP, rows of {sizes.bare_row:,}. MFU: 6 x parameters x positions computed / s / "
        "the card's dense bf16 peak.",
        "",
        "| batch | arm | tokens in samples | positions computed | s / step | tokens / s | vs bare loop | "
        "faster than padded | MFU | peak GiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *lines,
        "",
        f"Goals: packed >= 0.9x the bare loop on (a) ({_speed(a['packed'], bare):.2f}x), MFU >= 0.35 "
        f"({mfu(a['packed'])}), tree >= 3x faster than padded on (b) "
        f"({b['padded']['seconds'] / b['tree']['seconds']:.2f}x).",
    ])


def _speed(r: dict, bare: dict) -> float:
    return r["tokens"] / r["seconds"] / (bare["tokens"] / bare["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b", help="model shape (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm after a warm-up (default: %(default)s)")
    ap.add_argument("--words", type=float, default=1.0, help="scale the records' lengths (default: %(default)s)")
    ap.add_argument("--peak-tflops", type=float, help="the card's dense bf16 peak (default: known cards' peak)")
    ap.add_argument("--out", type=Path, help="also write the table to OUT/gpu_layouts.md")
    ap.add_argument("--docs", type=Path, metavar="TABLE",
                    help="only put TABLE (a gpu_layouts.md this script wrote) into docs/BENCHMARKS.md")
    args = ap.parse_args()
    if args.docs:
        from bench.docs_section import write_section

        write_section("gpu_layouts", args.docs.read_text().strip())
        return
    import torch

    from trainer.model.fsdp import init_distributed, shutdown

    scale = args.words
    base = Sizes()
    sizes = dataclasses.replace(base, **{k: max(int(getattr(base, k) * scale), 1)
                                          for k in ("long_answer", "system", "task", "answer")})
    if scale != 1.0:
        sizes = dataclasses.replace(sizes, micro_batch_tokens=max(int(base.micro_batch_tokens * scale), 256),
                                    bare_row=max(int(base.bare_row * scale), 64))
    dist = init_distributed()
    card = torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else f"CPU ({platform.processor()})"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in card), None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            model_dir = build_model(folder, args.shape, dist.device.type)
            batches = records(sizes)
            results = trainer_steps(model_dir, batches, sizes, args.steps, folder, dist)
            _free(dist.device)
            tokens = next(iter(results.values()))["padded"]["tokens"]
            bare = bare_loop(model_dir, tokens, sizes, args.steps, dist.device)
            _free(dist.device)
    finally:
        shutdown()
    text = table(bare, results, card, peak, args.shape, args.steps, sizes)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_layouts.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
