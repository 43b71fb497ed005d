#!/usr/bin/env python3
"""Summarise a scripts/reproduce directory: results.json and results.md.

    python3 scripts/study_summary.py DIR

Reads DIR/analysis.h5, DIR/manifest-*.json, DIR/teacher/{niah,ppl}.h5 and every DIR/runs/<v>-s<seed>/
({niah,ppl,run}.h5, rc). Needs h5py (Debian: python3-h5py). Missing or failed runs are listed, not
invented.
"""
import json
import math
import os
import sys

import h5py
import numpy as np

VARIANTS = {
    "a": "head-level 7:1, patching-guided",
    "b": "layer-wise 3:1",
    "c": "head-level 7:1, random heads",
    "d": "head-level 7:1, patching-guided, plain concatenation",
    "e": "head-level 3:1, patching-guided",
}


def read_eval(folder):
    out = {}
    niah, ppl = os.path.join(folder, "niah.h5"), os.path.join(folder, "ppl.h5")
    if os.path.exists(niah):
        with h5py.File(niah, "r") as f:
            acc = f["/niah/accuracy"][()]
            out["lengths"] = [int(x) for x in f["/niah/lengths"][()]]
            out["depths"] = [float(x) for x in f["/niah/depths"][()]]
            out["niah"] = acc.tolist()
            out["niah_by_length"] = acc.mean(axis=1).tolist()
    if os.path.exists(ppl):
        with h5py.File(ppl, "r") as f:
            out["ppl"] = float(f["/ppl/ppl"][0])
            out["nll"] = float(f["/ppl/nll"][0])
    return out


def read_run(path):
    with h5py.File(path, "r", swmr=True) as f:
        names = [n.decode() if isinstance(n, bytes) else n for n in f["/stages/name"][()]]
        ev_stage, ev_loss = f["/eval/stage"][()], f["/eval/loss"][()]
        last = {}
        for i, name in enumerate(names):
            sel = ev_loss[ev_stage == i]
            if len(sel):
                last[name] = float(sel[-1])
        elapsed = f["/train/elapsed_s"][()]
        return {"final_eval_loss": last, "train_seconds": float(elapsed[-1]) if len(elapsed) else None}


def mean_sd(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def head_findings(path, manifests):
    """Within-layer head heterogeneity vs between-layer similarity, from analysis.h5."""
    with h5py.File(path, "r") as f:
        tasks = [t.decode() if isinstance(t, bytes) else t for t in f["/examples/task"][()]]
        clean, corrupt = f["/examples/metric_clean"][()], f["/examples/metric_corrupt"][()]
        patched = f["/activation/noising/metric_patched"][()]  # [N, L, H]
        retrieval = np.array([t.startswith("niah") or t == "passkey" for t in tasks])
        # Noising effect on the retrieval examples, normalised by their mean clean-corrupt gap.
        gap = (clean - corrupt)[retrieval].mean()
        eff = (clean[retrieval][:, None, None] - patched[retrieval]).mean(axis=0) / gap
        sims = {k: f["/similarity/" + k][()].tolist() for k in ("cosine_delta", "cka", "angular") if "/similarity/" + k in f}
        retr_score = f["/retrieval/score"][()].tolist() if "/retrieval/score" in f else None
    L, H = eff.shape
    total = np.abs(eff).sum()
    order = np.argsort(-eff, axis=None)
    top = [(int(i // H), int(i % H), float(eff.flat[i])) for i in order[:8]]
    per_layer = []
    for l in range(L):
        row = eff[l]
        per_layer.append({"layer": l, "max": float(row.max()), "median": float(np.median(row)),
                          "min": float(row.min()), "spread": float(row.max() - np.median(row))})
    k = round(L * H / 8)
    share_top_k = float(np.sort(np.abs(eff), axis=None)[::-1][:k].sum() / total) if total > 0 else None
    cka = np.array(sims["cka"]) if "cka" in sims else None
    adjacent = [float(cka[l, l + 1]) for l in range(L - 1)] if cka is not None else None
    return {"retrieval_noising_effect": eff.tolist(), "top_heads": top, "per_layer": per_layer,
            "share_of_abs_effect_in_top_k": share_top_k, "k": k, "similarity": sims,
            "cka_adjacent_layers": adjacent, "retrieval_score": retr_score,
            "fa_heads": {v: m["fa_heads"] for v, m in manifests.items()}}


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    manifests = {}
    for name in sorted(os.listdir(root)):
        if name.startswith("manifest-") and name.endswith(".json"):
            manifests[name[len("manifest-"):-len(".json")]] = json.load(open(os.path.join(root, name)))
    result = {"teacher": read_eval(os.path.join(root, "teacher")), "variants": {}, "failed": []}
    runs_dir = os.path.join(root, "runs")
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        folder = os.path.join(runs_dir, name)
        if not os.path.isdir(folder):
            continue
        v, seed = name.split("-s")
        rc = open(os.path.join(folder, "rc")).read().strip() if os.path.exists(os.path.join(folder, "rc")) else "none"
        if rc != "0":
            result["failed"].append({"run": name, "rc": rc})
            continue
        run = read_eval(folder)
        run.update(read_run(os.path.join(folder, "run.h5")))
        run["seed"] = int(seed)
        mkey = "c-s" + seed if v == "c" else ("a" if v == "d" else v)
        run["fa_heads"] = len(manifests[mkey]["fa_heads"]) if mkey in manifests else None
        result["variants"].setdefault(v, {"name": VARIANTS.get(v, v), "runs": []})["runs"].append(run)
    for v, entry in result["variants"].items():
        runs = entry["runs"]
        n_len = len(runs[0].get("niah_by_length", []))
        entry["niah_by_length"] = [mean_sd([r["niah_by_length"][i] for r in runs]) for i in range(n_len)]
        entry["ppl"] = mean_sd([r.get("ppl") for r in runs])
        entry["fa_heads"] = runs[0]["fa_heads"]
    if os.path.exists(os.path.join(root, "analysis.h5")):
        result["heads"] = head_findings(os.path.join(root, "analysis.h5"), manifests)
    with open(os.path.join(root, "results.json.tmp"), "w") as f:
        json.dump(result, f, indent=1)
    os.replace(os.path.join(root, "results.json.tmp"), os.path.join(root, "results.json"))

    t = result["teacher"]
    lengths = t.get("lengths", [])
    lines = ["| model | FA heads | seeds | " + " | ".join(f"NIAH {n}" for n in lengths) + " | ppl |",
             "|---|---|---|" + "---|" * len(lengths) + "---|"]
    lines.append("| teacher (dense) | 48 | - | " + " | ".join(f"{x:.3f}" for x in t.get("niah_by_length", [])) +
                 f" | {t.get('ppl', float('nan')):.2f} |")
    fmt = lambda ms: "-" if ms[0] is None else (f"{ms[0]:.3f}" if ms[1] == 0 else f"{ms[0]:.3f} ± {ms[1]:.3f}")
    for v in sorted(result["variants"]):
        e = result["variants"][v]
        ppl = e["ppl"]
        ppl_s = "-" if ppl[0] is None else (f"{ppl[0]:.2f}" if ppl[1] == 0 else f"{ppl[0]:.2f} ± {ppl[1]:.2f}")
        lines.append(f"| ({v}) {e['name']} | {e['fa_heads']} | {len(e['runs'])} | " +
                     " | ".join(fmt(ms) for ms in e["niah_by_length"]) + f" | {ppl_s} |")
    for fail in result["failed"]:
        lines.append(f"\nfailed: {fail['run']} (rc {fail['rc']})")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(root, "results.md"), "w") as f:
        f.write(md)
    print(md)
    if "heads" in result:
        h = result["heads"]
        print("top retrieval heads (layer, head, normalised noising effect):",
              ", ".join(f"{l}:{hh} {e:.2f}" for l, hh, e in h["top_heads"]))
        print(f"share of |effect| in the top {h['k']} heads: {h['share_of_abs_effect_in_top_k']:.2f}")
        if h["cka_adjacent_layers"]:
            print("CKA of adjacent layers:", ", ".join(f"{x:.2f}" for x in h["cka_adjacent_layers"]))


if __name__ == "__main__":
    main()
