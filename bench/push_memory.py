"""Host memory and bytes of one weight push, the way before issue 25 and now, side by side in one run.

    .venv/bin/python bench/push_memory.py [--layers 24] [--hidden 896] [--ranks 2] [--shard-mib 256] [--no-docs]

A random Qwen2 model built offline from a config (by default the shape of Qwen2.5-0.5B: 494M parameters, tied
embeddings, which the push writes out as the engine's untied output layer), float32 master weights sharded by
trainer.model.fsdp.shard over `--ranks` CPU processes (torchrun, gloo), as the trainer holds them. On the main rank:

    before  trainer.model.fsdp.full_state_dict (the whole float32 state gathered to the host), then the push's old
            write: the state untied on the CPU (the output layer a copy) and one float32 model.safetensors;
    now     WeightSync.write of the sharded model itself (the other ranks run follow_push): each tensor gathered,
            cast to bfloat16 (the engine's dtype on a GPU) and written shard by shard (`--shard-mib`).

Measured on the main rank for each way: the peak resident memory over the resident memory just before the push
(VmHWM reset through /proc/self/clear_refs), the bytes written and the seconds taken. On a GPU machine the model
and each gathered float32 tensor live in GPU memory; here the device is the host, so "now" also holds the largest
tensor gathered in float32 while it is cast, which the table states separately.

Writes its section of docs/BENCHMARKS.md (between the push_memory markers) unless --no-docs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.docs_section import write_section  # noqa: E402

MIB = 2**20


def _rss_and_reset_peak() -> int:
    """Resident bytes now, with the peak (VmHWM) reset to it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _old_write(state: dict, out: Path) -> list[Path]:
    """The push's write before issue 25 (trainer/weight_sync.py at c31202a): untied on the CPU, one float32
    file."""
    from safetensors.torch import save_file

    from trainer.model.files import unshared_contiguous

    tensors = unshared_contiguous(state)
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return [out / "model.safetensors"]


def worker(args: argparse.Namespace) -> None:
    """One rank: build, shard, then each way in turn; the main rank writes its measurements to args.result."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from trainer.model.fsdp import full_state_dict, init_distributed, shard, shutdown
    from trainer.model.weight_sync import WeightSync, follow_push

    dist = init_distributed(device="cpu")
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=2, vocab_size=args.vocab,
                         tie_word_embeddings=True, max_position_embeddings=2048)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    model = shard(model, dist)
    build_s = time.perf_counter() - started
    work = Path(args.work)
    config_dir = work / "config"
    if dist.is_main:
        config_dir.mkdir(parents=True, exist_ok=True)
        untied = config.to_dict() | {"tie_word_embeddings": False}
        (config_dir / "config.json").write_text(json.dumps(untied))
    results = {"params": params, "largest_tensor": largest, "build_s": build_s, "world": dist.world}
    for way in args.ways:
        gc.collect()
        torch.distributed.barrier()
        before = _rss_and_reset_peak()
        started = time.perf_counter()
        out = work / way
        if way == "before":
            state = full_state_dict(model, dist)
            if dist.is_main:
                out.mkdir()
                files = _old_write(state, out)
            del state
        elif dist.is_main:
            sync = WeightSync("http://127.0.0.1:9", out, model_dir=config_dir, dtype=torch.bfloat16,
                              max_shard_bytes=args.shard_mib * MIB)
            weights_dir, _ = sync.write(model, 1)
            files = [p for p in weights_dir.iterdir() if p.name.startswith("model")]
        else:
            follow_push(model)
        seconds = time.perf_counter() - started
        peak = _status("VmHWM")
        if dist.is_main:
            results[way] = {"peak_increase": peak - before, "rss_before": before, "seconds": seconds,
                            "bytes": sum(p.stat().st_size for p in files if p.suffix == ".safetensors"),
                            "files": len([p for p in files if p.suffix == ".safetensors"])}
            shutil.rmtree(out)
        torch.distributed.barrier()
    if dist.is_main:
        Path(args.result).write_text(json.dumps(results))
    shutdown()


def report(r: dict, args: argparse.Namespace) -> str:
    import safetensors
    import torch

    before, now = r["before"], r["now"]
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    bf16_weights = (r["params"] + args.vocab * args.hidden) * 2  # the untied output layer written out too
    lines = [
        "## push_memory (bench/push_memory.py)",
        "",
        f"`.venv/bin/python bench/push_memory.py --layers {args.layers} --hidden {args.hidden} --ranks {args.ranks} "
        f"--shard-mib {args.shard_mib}` on {date.today().isoformat()}: {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}, safetensors {safetensors.__version__}; "
        f"1-minute load average {os.getloadavg()[0]:.1f} at the end (other work shares this machine).",
        "",
        f"A random Qwen2 of {r['params'] / 1e6:.0f}M parameters (hidden {args.hidden}, {args.layers} layers, "
        f"vocabulary {args.vocab}, tied embeddings, written untied for the engine), float32, sharded by "
        f"trainer.model.fsdp.shard over {r['world']} CPU ranks (gloo). Peak resident memory of the main rank over its "
        "resident memory just before the push (VmHWM reset through /proc/self/clear_refs):",
        "",
        "| push | written | files | peak extra host memory | seconds |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| before: full_state_dict, then one float32 model.safetensors | {gib(before['bytes'])} | {before['files']} "
        f"| {gib(before['peak_increase'])} | {before['seconds']:.1f} |",
        f"| now: WeightSync.write(model), gathered tensor by tensor, bfloat16, {args.shard_mib} MiB shards | "
        f"{gib(now['bytes'])} | {now['files']} | {gib(now['peak_increase'])} | {now['seconds']:.1f} |",
        f"| **now / before** | **{now['bytes'] / before['bytes']:.2f}x** | | "
        f"**{now['peak_increase'] / before['peak_increase']:.2f}x** | {now['seconds'] / before['seconds']:.2f}x |",
        "",
        f"- The bound of issue 25: the weights in bfloat16 ({gib(bf16_weights)} here) plus one shard "
        f"({args.shard_mib} MiB). Now: {gib(now['peak_increase'])} over the trainer's own memory, about one shard "
        f"in bfloat16 plus, on this CPU-only machine, the float32 buffers of gathering the largest tensor before "
        f"its cast (the embeddings: {gib(r['largest_tensor'] * 4)}); on a GPU the gather and the cast happen in "
        "GPU memory and only the bfloat16 copy reaches the host. Before: the whole float32 state on the host (the "
        "main rank's own half again, the other rank's half, the output layer copied), whatever the engine's dtype.",
        "- A push of Qwen2.5-1.5B (1.54B parameters, tied) in bfloat16 by the same arithmetic: before, "
        f"{1.54e9 * 4 / 2**30 + 151936 * 1536 * 4 / 2**30:.1f} GiB of host memory and of file; now, one shard "
        "(WeightSync's default, 1 GiB) of host memory, "
        f"{(1.54e9 + 151936 * 1536) * 2 / 2**30:.1f} GiB of files.",
        f"- Built and sharded in {r['build_s']:.0f} s per rank; the seconds above include the all-gathers over gloo.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--ways", nargs="+", default=["before", "now"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from trainer.model.fsdp import launch

    with tempfile.TemporaryDirectory(prefix="push-memory-") as folder:
        result = Path(folder) / "result.json"
        forwarded = [a for a in sys.argv[1:] if a != "--no-docs"]
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        code = launch(args.ranks, [__file__, *forwarded, "--worker", "--work", folder, "--result", str(result)])
        if code != 0:
            raise SystemExit(f"the {args.ranks} ranks exited with {code}")
        measured = json.loads(result.read_text())
    text = report(measured, args)
    print(text)
    if not args.no_docs:
        write_section("push_memory", text)


if __name__ == "__main__":
    main()
