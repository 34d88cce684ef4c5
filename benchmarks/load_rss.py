"""Peak RSS of loading a saved checkpoint into a packed replica: vcfslm's loader beside
transformers' from_pretrained, each in a fresh child process, one after the other.

    vcfslm model write synthetic:phi-3-mini /tmp/phi3-full      # once: ~7.6 GB on disk
    .venv/bin/python benchmarks/load_rss.py /tmp/phi3-full
    .venv/bin/python benchmarks/load_rss.py /tmp/phi3-full --ways loader,from_pretrained

A quicker run (about a minute a way on 2 cores): synthetic:phi-3-mini,layers=4 (1.3 GB).

Ways:
- loader: load_model(folder, plan=...): a meta-device skeleton filled a linear (or a tensor)
  at a time through safetensors' safe_open and load_state_dict(assign=True), each linear
  packed as it arrives and its file handle dropped after it (vcfslm.engine.loader);
- loader+hook: the same with a before_pack hook that runs one forward pass of 8 tokens on
  the mapped, unpacked model (what a numerics gate's reference costs: every page is read);
- loader+engine: load_model(folder) unpacked (every tensor copied out of its file), then
  DecodeEngine packs (the worker's call sequence when it passes no plan);
- from_pretrained: AutoModelForCausalLM.from_pretrained(folder, dtype=bf16), then
  DecodeEngine packs (the load before the loader).

Each child reads its RSS after importing torch, transformers, the model's modeling code and
packing one small linear (its baseline), loads, and reads VmHWM. Printed: the weights loaded,
the baseline, the peak, peak / weights and (peak - baseline) / weights. Nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WAYS = ("loader", "loader+hook", "loader+engine", "from_pretrained")
TARGET = 1.3


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def child(way: str, folder: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from vcfslm.engine.decode import DecodeEngine
    from vcfslm.engine.linear import default_plan, pack_linears
    from vcfslm.engine.model import LoadedModel, load_model, parse_model_spec

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(folder))]  # import its modeling code
    plan = default_plan()
    pack_linears(torch.nn.Sequential(torch.nn.Linear(256, 256, dtype=torch.bfloat16)), plan)
    baseline = _status("VmRSS:")
    started = time.perf_counter()
    if way in ("loader", "loader+hook"):
        hook_s = []

        def reference_forward(model):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(torch.arange(1, 9).view(1, 8))
            hook_s.append(time.perf_counter() - t0)

        loaded = load_model(folder, plan=plan, before_pack=reference_forward if way == "loader+hook" else None)
        kernel = plan.label + (f"; hook {hook_s[0]:.1f} s" if hook_s else "")
    elif way == "loader+engine":
        loaded = load_model(folder)
        kernel = DecodeEngine(loaded.model, "eager", plan=plan).plan.label
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        kernel = DecodeEngine(model, "eager", plan=plan).plan.label
        loaded = LoadedModel(model, parse_model_spec(folder), 0.0, False)
    return {"way": way, "load_s": time.perf_counter() - started, "baseline": baseline, "hwm": _status("VmHWM:"),
            "rss": _status("VmRSS:"), "weight_bytes": loaded.weight_bytes, "kernel": kernel}


def run_child(way: str, folder: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, str(folder), "--child", way], capture_output=True, text=True,
                          check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("CHILD ")), None)
    if done.returncode != 0 or line is None:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{way} child failed ({done.returncode})")
    return json.loads(line[len("CHILD "):])


def ways(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in WAYS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown way(s) {', '.join(bad) or '(none)'}; known: {', '.join(WAYS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a save_pretrained folder")
    ap.add_argument("--ways", type=ways, default=list(WAYS), help=f"subset of {','.join(WAYS)}")
    ap.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("CHILD " + json.dumps(child(args.child, str(args.checkpoint))))
        return 0
    if not (args.checkpoint / "config.json").is_file():
        ap.error(f"{args.checkpoint}: no config.json (not a save_pretrained folder)")
    sys.path.insert(0, str(HERE))
    from decode_efficiency import cpu_line

    print(cpu_line())
    size = sum(p.stat().st_size for p in args.checkpoint.glob("*.safetensors"))
    print(f"checkpoint {args.checkpoint}: {size / 1e9:.2f} GB of safetensors; one child process per way, in turn")
    print(f"{'way':<16} {'weights GB':>10} {'baseline GB':>11} {'peak RSS GB':>11} {'peak/weights':>12} "
          f"{'(peak-base)/weights':>19} {'load s':>7}  kernel")
    for way in args.ways:
        r = run_child(way, args.checkpoint)
        w = r["weight_bytes"]
        print(f"{way:<16} {w / 1e9:10.3f} {r['baseline'] / 1e9:11.3f} {r['hwm'] / 1e9:11.3f} {r['hwm'] / w:12.3f} "
              f"{(r['hwm'] - r['baseline']) / w:19.3f} {r['load_s']:7.1f}  {r['kernel']}", flush=True)
    print(f"target: peak RSS <= {TARGET} x weights loading a saved checkpoint (issue 30); "
          f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
