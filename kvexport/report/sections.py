# SPDX-License-Identifier: Apache-2.0
"""The report's sections, built from the report dictionary (:func:`kvexport.report.collect.collect`).

Order: summary (with the warnings to read first), parity and what compression cost, plots, cache,
latency per backend, memory, disk, next steps, machine, studies, settings, stages."""

from __future__ import annotations

import shlex
from typing import Any

from kvexport.export.quality import THRESHOLDS, quality_line
from kvexport.report.blocks import (
    Code,
    Section,
    Table,
    Warn,
    fmt,
    fmt_bytes,
    fmt_pct,
    fmt_ratio,
    fmt_sig,
    fmt_spread,
    verdict_text,
)

#: relative p10-p90 width over repeated runs above which a latency is called unreliable
SPREAD_WARN = 0.25
#: converted / baseline latency above which the converted model is called slower
SLOWER_WARN = 1.10
#: CPU cores kept busy by other processes while profiling above which the machine is called loaded
LOAD_WARN = 0.5


# ----------------------------------------------------------------------------- plain-words summaries
def fidelity_summary(fid: dict[str, Any]) -> str:
    """parity.json's ``fidelity`` in one line: agreement, perplexity change, recall."""
    if fid.get("skipped"):
        return f"not measured ({fid['skipped']})"
    parts = []
    if fid.get("next_token_agreement") is not None:
        parts.append(f"next-token agreement {fmt_pct(fid['next_token_agreement'])}")
    if fid.get("ppl_original") is not None and fid.get("ppl_converted") is not None:
        parts.append(f"perplexity {fid['ppl_original']:.3g} → {fid['ppl_converted']:.3g} "
                     f"({fmt_pct(fid.get('ppl_increase'), signed=True)})")
    if fid.get("mean_kl") is not None:
        parts.append(f"KL {fid['mean_kl']:.3g} nats/token")
    for name, r in (fid.get("recall") or {}).items():
        if isinstance(r, dict) and r.get("original") is not None:
            un = " (uninformative: the original fails it)" if r["original"] < THRESHOLDS["recall_solved"] else ""
            parts.append(f"{name.replace('_', ' ')} {r['original']:.2f} → {r.get('converted', float('nan')):.2f}{un}")
    gates = fid.get("gates") or {}
    if gates.get("passed") is not None:
        parts.append("gates " + ("passed" if gates["passed"] else "FAILED"))
    return ", ".join(parts) or "no figures"


def _is_cpu(prof: dict[str, Any]) -> bool:
    env = prof.get("environment") or {}
    return prof.get("backend") in ("onnxruntime", "pytorch") and not env.get("gpu") and not env.get("jetson")


def _pair_rows(prof: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    vs = prof.get("variants") or {}
    base = {r["context"]: r for r in (vs.get("baseline") or {}).get("contexts") or []}
    return [(r, base[r["context"]]) for r in (vs.get("converted") or {}).get("contexts") or [] if r["context"] in base]


def profile_warnings(prof: dict[str, Any] | None) -> list[str]:
    """What a reader must know before trusting the profile's numbers, in plain words (empty when nothing)."""
    if not prof:
        return []
    out = []
    env = prof.get("environment") or {}
    backend = prof.get("backend", "?")
    if _is_cpu(prof):
        cpu = env.get("cpu_model") or env.get("machine") or "a CPU"
        out.append(f"These latencies were measured on a CPU ({cpu}, {env.get('cpu_count', '?')} cores, {backend}). "
                   "They do not carry over to a Jetson or any GPU: build TensorRT engines on the target and profile "
                   "there (see Next steps).")
    load = prof.get("machine_load") or {}
    if load.get("other_cores") is not None and load["other_cores"] >= LOAD_WARN:
        la = load.get("load_avg_end") or load.get("load_avg_start")
        out.append(f"The machine was busy: other processes kept {load['other_cores']:.1f} of {load.get('cpu_count')} "
                   f"CPU cores busy while profiling" + (f" (load average {la[0]:.1f})" if la else "") + ".")
    wide = []
    for name, v in (prof.get("variants") or {}).items():
        for r in v.get("contexts") or []:
            for key, label in (("decode_ms_p50", "decode p50"), ("ttft_s", "time to first token")):
                sp = (r.get("spread") or {}).get(key)
                if sp and sp.get("relative", 0) > SPREAD_WARN:
                    unit = "ms" if key.endswith("ms_p50") else "s"
                    wide.append(f"{name} {label} at {r['context']} tokens: {fmt_sig(sp['p10'])}–{fmt_sig(sp['p90'])} "
                                f"{unit}")
    if wide:
        out.append(f"Latency moved by more than {SPREAD_WARN:.0%} between repeated runs ({'; '.join(wide[:4])}"
                   + (f"; {len(wide) - 4} more" if len(wide) > 4 else "") + "). Rerun on a quiet machine before "
                   "drawing conclusions from these numbers.")
    slower = []
    for c, b in _pair_rows(prof):
        for key, label, unit in (("decode_ms_p50", "decode p50", "ms"), ("ttft_s", "first token", "s")):
            if b.get(key) and c.get(key) and c[key] > SLOWER_WARN * b[key]:
                slower.append(f"{label} at {c['context']} tokens: {fmt_sig(c[key])} vs {fmt_sig(b[key])} {unit} "
                              f"({fmt_ratio(c[key] / b[key])} slower)")
    if slower:
        shape = (prof.get("cache") or {}).get("shape") or {}
        why = ""
        if not shape.get("budget") and shape.get("capacity"):
            why = (f" Without a press the export holds a full cache of up to {shape['capacity']} slots in power-of-two "
                   "buckets and attends over its whole bucket (at most twice the filled slots) at every step; a "
                   "press bounds the cache, and the step's cost, whatever the context.")
        out.append("The converted model is slower than the uncompressed baseline here: " + "; ".join(slower) + "."
                   + why)
    return out


def all_warnings(rep: dict[str, Any]) -> list[str]:
    out = []
    parity = rep.get("parity")
    if parity is not None and not parity["passed"]:
        out.append("Parity FAILED: the exported graphs do not reproduce the PyTorch model within tolerance "
                   "(see Parity).")
    fid = fidelity_of(rep)
    if fid and quality(fid)["level"] in ("LOST", "DEGRADED"):
        out.append(quality_line(fid) + ". Parity only says the export computes what the compressed model computes; "
                   "see What compression cost.")
    if fid and (fid.get("gates") or {}).get("passed") is False:
        out.append("A fidelity gate failed: the compressed model is further from the original than allowed "
                   "(see What compression cost).")
    for backend, prof in (rep.get("profiles") or {}).items():
        for w in profile_warnings(prof):
            out.append(w if len(rep.get("profiles") or {}) == 1 else f"[{backend}] {w}")
    return out


def quality(fid: dict[str, Any]) -> dict[str, Any]:
    """The quality verdict parity.json records (recomputed for an older parity.json without one)."""
    from kvexport.export.quality import quality_verdict

    q = fid.get("quality")
    return q if isinstance(q, dict) and "level" in q else quality_verdict(fid)


def quality_block(fid: dict[str, Any], html_id: str | None) -> tuple:
    """The quality verdict as a report block: green KEPT, amber DEGRADED, red LOST, grey UNMEASURED."""
    level = quality(fid)["level"]
    cls = {"KEPT": True, "LOST": False, "DEGRADED": "degraded"}.get(level)
    return ("verdict", quality_line(fid), cls, html_id)


def fidelity_of(rep: dict[str, Any]) -> dict[str, Any] | None:
    parity = rep.get("parity") or {}
    fid = (parity.get("raw") or {}).get("fidelity")
    return fid if isinstance(fid, dict) else None


# ----------------------------------------------------------------------------- sections
def build_sections(rep: dict[str, Any], plot_stems: dict[str, str]) -> list[Section]:
    secs = [_summary(rep), _parity(rep)]
    fid = fidelity_of(rep)
    if fid:
        secs.append(_fidelity_section(fid))
    if isinstance(rep.get("twin"), dict):
        secs.append(_twin_section(rep["twin"]))
    if plot_stems:
        s = Section("Plots", "plots")
        for stem, caption in plot_stems.items():
            s.blocks.append(("img", stem, caption))
        secs.append(s)
    secs += [_cache(rep), _latency(rep), _memory(rep)]
    if rep.get("artifacts"):
        secs.append(_disk(rep))
    secs.append(_next_steps(rep))
    machine = _machine(rep)
    if machine is not None:
        secs.append(machine)
    if rep.get("studies"):
        secs.append(_studies(rep))
    secs.append(_settings(rep))
    stages = _stages(rep)
    if stages is not None:
        secs.append(stages)
    return secs


def _summary(rep: dict[str, Any]) -> Section:
    conv = rep.get("convert") or {}
    prof = rep.get("profile") or {}
    settings = conv.get("settings") or {}
    model = conv.get("model") or {}
    cache = prof.get("cache") or {}
    s = Section("Summary", "summary")
    for w in all_warnings(rep):
        s.blocks.append(Warn(w))
    if fidelity_of(rep):
        s.blocks.append(quality_block(fidelity_of(rep), "quality-verdict"))
    rows = [["model", model.get("name") or settings.get("model") or "-"], ["family", model.get("family", "-")],
            ["parity", verdict_text(rep.get("parity")).split(": ", 1)[1]]]
    fid = fidelity_of(rep)
    if fid:
        rows.append(["quality (vs the original model)", quality_line(fid)])
        rows.append(["what compression cost", fidelity_summary(fid)])
    if isinstance(rep.get("twin"), dict):
        rows.append([twin_label(rep["twin"]), twin_summary(rep["twin"])])
    if cache:
        rows.append(["KV bytes per token (converted / baseline)",
                     f"{fmt_bytes(cache.get('bytes_per_token'))} / {fmt_bytes(cache.get('baseline_bytes_per_token'))}"
                     f" ({fmt_ratio(cache.get('per_token_ratio'))} smaller per token)"])
        ctx = cache.get("contexts") or []
        if ctx:
            last = ctx[-1]
            rows.append([f"KV cache at {last['context']} tokens (converted / baseline)",
                         f"{fmt_bytes(last['kv_bytes'])} / {fmt_bytes(last['baseline_kv_bytes'])} "
                         f"({fmt_ratio(last['ratio'])} smaller)"])
    pairs = _pair_rows(prof)
    if pairs:
        for key, label, unit in (("decode_ms_p50", "decode p50", "ms"), ("ttft_s", "time to first token", "s")):
            rows.append([f"{label}, converted vs baseline ({prof.get('backend', '?')})",
                         "; ".join(f"{c['context']}: {fmt_sig(c[key])} vs {fmt_sig(b[key])} {unit} "
                                   f"({_faster(c[key], b[key])})" for c, b in pairs)])
    else:
        conv_rows = ((prof.get("variants") or {}).get("converted") or {}).get("contexts") or []
        if conv_rows:
            rows.append([f"decode p50 ({prof.get('backend', '?')})",
                         "; ".join(f"{r['context']}: {fmt_sig(r['decode_ms_p50'])} ms" for r in conv_rows)])
    s.blocks.append(Table(["", ""], rows))
    return s


def _faster(conv: float, base: float) -> str:
    if not conv or not base:
        return "-"
    return f"{fmt_ratio(base / conv)} faster" if conv <= base else f"{fmt_ratio(conv / base)} slower"


def _parity(rep: dict[str, Any]) -> Section:
    parity = rep.get("parity")
    s = Section("Parity", "parity")
    s.blocks.append(("verdict", verdict_text(parity), None if parity is None else parity["passed"]))
    if parity is None:
        s.blocks.append("Validation was not run (--no-validate).")
        return s
    s.blocks.append("The exported graphs against the PyTorch model they were made from (same weights, same "
                    "cache rules): does the export compute what the compressed model computes?")
    hdr = ["backend pair", "max abs logit error", "max rel logit error", "token agreement", "index agreement",
           "steps", "verdict"]
    s.blocks.append(Table(hdr, [[p["pair"], fmt(p.get("max_abs_logit_error")), fmt(p.get("max_rel_logit_error")),
                                 fmt(p.get("token_agreement")), fmt(p.get("index_agreement")), fmt(p.get("steps")),
                                 "PASSED" if p.get("passed") else ("FAILED" if p.get("passed") is False else "-")]
                                for p in parity["pairs"]]))
    if parity.get("tolerances"):
        s.blocks.append("Tolerances: " + ", ".join(f"{k} = {fmt(v)}" for k, v in parity["tolerances"].items()))
    return s


def _fidelity_section(fid: dict[str, Any]) -> Section:
    s = Section("What compression cost", "fidelity")
    if fid.get("skipped"):
        s.blocks.append(f"Not measured: {fid['skipped']}.")
        return s
    s.blocks.append(f"The converted model ({fid.get('candidate', '?')}) against the reference, the "
                    f"{fid.get('reference', '?')}, on {fid.get('eval_data', '?')}: "
                    f"{fid.get('scored_tokens', '?')} tokens scored after a {fid.get('prefix_tokens', '?')}-token "
                    "prefix. Parity above says the export is faithful to the compressed model; this says what the "
                    "compression itself changed.")
    rows = [["next-token agreement", fmt_pct(fid.get("next_token_agreement")),
             "how often the greedy next token equals the original model's"],
            ["mean KL(original ‖ converted)", f"{fmt(fid.get('mean_kl'))} nats/token",
             "0 = the same next-token distribution"],
            ["perplexity", f"{_g3(fid.get('ppl_original'))} → {_g3(fid.get('ppl_converted'))} "
                           f"({fmt_pct(fid.get('ppl_increase'), signed=True)})", "original → converted, held-out text"]]
    un = quality(fid)["uninformative"]
    for name, r in (fid.get("recall") or {}).items():
        if isinstance(r, dict):
            rows.append([name.replace("_", " "), f"{_f2(r.get('original'))} → {_f2(r.get('converted'))}",
                         f"accuracy, original → converted, {r.get('examples', '?')} examples"
                         + ("; uninformative: the original fails it too" if name in un else "")])
    s.blocks.insert(0, quality_block(fid, None))
    s.blocks.append(Table(["measure", "value", "meaning"], rows))
    t = THRESHOLDS
    s.blocks.append(f"Quality verdict: LOST when next-token agreement < {t['agreement']['lost']:.0%}, perplexity "
                    f"> +{t['ppl_increase']['lost']:.0%}, or a recall task the original solves (>= "
                    f"{t['recall_solved']:.2f}) keeps < {t['recall_kept']['lost']:.0%} of its accuracy; DEGRADED "
                    f"below {t['agreement']['degraded']:.0%} / above +{t['ppl_increase']['degraded']:.0%} / under "
                    f"{t['recall_kept']['degraded']:.0%}; KEPT otherwise.")
    g = fid.get("gates") or {}
    if g.get("min_agreement") is not None or g.get("max_ppl_increase") is not None:
        s.blocks.append("Gates: " + ", ".join(x for x in (
            f"next-token agreement >= {fmt_pct(g['min_agreement'])}" if g.get("min_agreement") is not None else "",
            f"perplexity increase <= {fmt_pct(g['max_ppl_increase'], signed=True)}"
            if g.get("max_ppl_increase") is not None else "") if x)
            + (": " + ("PASSED" if g.get("passed") else "FAILED") if g.get("passed") is not None else ""))
    return s


def twin_label(tw: dict[str, Any]) -> str:
    return tw.get("label") or f"{tw.get('kv_dtype', '?')} cache vs its fp32 twin"


def twin_summary(tw: dict[str, Any]) -> str:
    """parity.json's ``twin`` in one line: agreement, KL, max |Δlogit|, cache bytes of both."""
    k = tw.get("kv_dtype", "?")
    cb = tw.get("cache_bytes") or {}
    return (f"next-token agreement {fmt_pct(tw.get('next_token_agreement'))}, KL {fmt(tw.get('mean_kl'))} nats/token, "
            f"max |Δlogit| {_g3(tw.get('max_abs_logit_diff'))}, cache {fmt_bytes(cb.get(k))} vs "
            f"{fmt_bytes(cb.get('fp32'))} in fp32")


def _twin_section(tw: dict[str, Any]) -> Section:
    k = tw.get("kv_dtype", "?")
    s = Section(twin_label(tw), "twin")
    s.blocks.append(f"The PyTorch cache in {k} against its fp32 twin: the same converted model, press, budget, window "
                    f"and chunk, run twice by kvexport.generation.generate (kv_dtype={k} and kv_dtype=fp32), on "
                    f"{tw.get('eval_data', '?')}: {tw.get('windows', '?')} windows of {tw.get('prefix_tokens', '?')} "
                    f"tokens, then {tw.get('scored_tokens', '?')} positions teacher-forced with the fp32 twin's greedy "
                    "tokens. Parity above compares the export with the PyTorch cache in the same format; "
                    "'What compression cost' compares it with the original model.")
    rb = tw.get("resident_bytes") or {}
    cb = tw.get("cache_bytes") or {}
    margin = tw.get("fp32_margin") or {}
    rows = [["next-token agreement", fmt_pct(tw.get("next_token_agreement")),
             f"argmax of the {k} cache = the fp32 twin's greedy token"],
            [f"mean KL(fp32 ‖ {k})", f"{fmt(tw.get('mean_kl'))} nats/token", "0 = the same distribution"],
            ["max |Δlogit|", _g3(tw.get("max_abs_logit_diff")), "largest logit difference at any position"],
            ["kept sets equal", fmt_pct(tw.get("kept_agreement")) if tw.get("kept_agreement") is not None else "-",
             "eviction decisions the format left unchanged (per compaction, layer, row, head)"],
            ["fp32 top-1 margin where they disagree", _g3(margin.get("median_disagreeing")),
             f"median logit gap; over all positions {_g3(margin.get('median_all'))} (small = a near-tie)"],
            [f"cache bytes ({k} / fp32)", f"{fmt_bytes(cb.get(k))} / {fmt_bytes(cb.get('fp32'))}",
             "K/V (or latent) rows + scales"],
            [f"resident bytes ({k} / fp32)",
             f"{fmt_bytes(sum((rb.get(k) or {}).values()))} / {fmt_bytes(sum((rb.get('fp32') or {}).values()))}",
             "every cache buffer: rows, scales, positions, query ring"]]
    s.blocks.append(Table(["measure", "value", "meaning"], rows))
    return s


def _g3(v: Any) -> str:
    return "-" if v is None else f"{float(v):.3g}"


def _f2(v: Any) -> str:
    return "-" if v is None else f"{float(v):.2f}"


def _cache(rep: dict[str, Any]) -> Section:
    cache = (rep.get("profile") or {}).get("cache") or {}
    s = Section("Cache compression", "cache")
    if not cache:
        s.blocks.append("No cache accounting (profile not run).")
        return s
    sh = cache.get("shape") or {}
    s.blocks.append(
        f"Per token and sequence: {fmt_bytes(cache.get('bytes_per_token'))} cached, against "
        f"{fmt_bytes(cache.get('baseline_bytes_per_token'))} for the original model's full cache "
        f"({fmt_ratio(cache.get('per_token_ratio'))}). "
        + (f"Static budget {sh.get('budget')} + window {sh.get('window')} slots per layer: the cache size "
           "does not grow with the context." if sh.get("budget") else
           f"Full cache of up to {sh.get('capacity')} slots (the export's capacity), held in power-of-two buckets "
           "of the context."
           if sh.get("capacity") else "Full cache: grows with the context."))
    s.blocks.append(Table(["context", "KV cache (converted)", "KV cache (baseline)", "ratio", "position indices"],
                          [[r["context"], fmt_bytes(r["kv_bytes"]), fmt_bytes(r["baseline_kv_bytes"]),
                            fmt_ratio(r["ratio"]), fmt_bytes(r.get("index_bytes"))]
                           for r in cache.get("contexts") or []]))
    return s


def _latency(rep: dict[str, Any]) -> Section:
    s = Section("Latency", "latency")
    profiles = rep.get("profiles") or {}
    if not profiles:
        s.blocks.append("Profile not run (--no-profile).")
        return s
    for backend, prof in profiles.items():
        vs = prof.get("variants") or {}
        reps = prof.get("repeats")
        s.blocks.append(f"{backend}: {prof.get('decode_steps', '?')} decode steps per context"
                        + (f", {reps} runs per context (in brackets: p10–p90 over the runs)" if reps else
                           " (one run per context: no spread recorded)")
                        + "; prompts of random token ids; one warm-up run not counted.")
        for name, v in vs.items():
            s.blocks.append(f"{backend}, {name}:")
            s.blocks.append(Table(["context", "time to first token (s)", "prefill tokens/s", "decode p50 (ms)",
                                   "decode p90 (ms)", "tokens/s"],
                                  [[r["context"], fmt_spread(r["ttft_s"], (r.get("spread") or {}).get("ttft_s")),
                                    fmt_sig(r.get("prefill_tokens_per_s")),
                                    fmt_spread(r["decode_ms_p50"], (r.get("spread") or {}).get("decode_ms_p50")),
                                    fmt_spread(r["decode_ms_p90"], (r.get("spread") or {}).get("decode_ms_p90")),
                                    fmt_sig(r["tokens_per_s"])] for r in v.get("contexts") or []]))
        skipped = prof.get("skipped_contexts")
        if skipped:
            s.blocks.append("Skipped contexts: " + "; ".join(f"{k['context']} ({k['reason']})" for k in skipped))
    return s


def _memory(rep: dict[str, Any]) -> Section:
    s = Section("Memory", "memory")
    profiles = rep.get("profiles") or {}
    if not profiles:
        s.blocks.append("Profile not run (--no-profile).")
        return s
    for backend, prof in profiles.items():
        for name, v in (prof.get("variants") or {}).items():
            rows = v.get("contexts") or []
            resident = any("resident" in r for r in rows)
            hdr = ["context", "KV cache (analytic)"] + (["resident per sequence", "of which K/V"] if resident else [])
            hdr += ["process peak RSS", "RSS growth during run"]
            extra = [k for k in ("gpu_memory_used_bytes", "torch_cuda_peak_bytes", "engine_device_memory_bytes")
                     if any(k in r for r in rows)]
            s.blocks.append(f"{backend}, {name}:")
            s.blocks.append(Table(hdr + [k.replace("_bytes", "").replace("_", " ") for k in extra],
                                  [[r["context"], fmt_bytes(r.get("kv_bytes"))]
                                   + ([fmt_bytes((r.get("resident") or {}).get("total")),
                                       fmt_bytes((r.get("resident") or {}).get("kv"))] if resident else [])
                                   + [fmt_bytes(r.get("peak_rss_bytes")), fmt_bytes(r.get("rss_delta_bytes"))]
                                   + [fmt_bytes(r.get(k)) for k in extra] for r in rows]))
            if resident and rows and rows[-1].get("resident"):
                parts = {k: b for k, b in rows[-1]["resident"].items() if k not in ("total", "kv")}
                if parts:
                    s.blocks.append("Besides K/V, a sequence keeps resident: " + ", ".join(
                        f"{k.replace('_', ' ')} {fmt_bytes(b)}" for k, b in sorted(parts.items())) + ".")
            teg = [r for r in rows if r.get("tegrastats")]
            if teg:
                s.blocks.append(Table(["context", "RAM peak (MB)", "GPU load mean (%)", "GPU freq max (MHz)",
                                       "power mean (mW)"],
                                      [[r["context"], fmt(r["tegrastats"].get("ram_used_mb_peak")),
                                        fmt(r["tegrastats"].get("gpu_load_pct_mean")),
                                        fmt(r["tegrastats"].get("gpu_freq_mhz_max")),
                                        ", ".join(f"{k} {x['mean']:.0f}" for k, x in
                                                  (r["tegrastats"].get("power_mw") or {}).items())]
                                       for r in teg]))
    return s


def _disk(rep: dict[str, Any]) -> Section:
    s = Section("Disk", "disk")
    arts = rep["artifacts"]
    s.blocks.append(f"{fmt_bytes(sum(a['bytes'] for a in arts))} in all. What each part holds and why it has "
                    "that size:")
    s.blocks.append(Table(["path", "size", "why"], [[a["path"], fmt_bytes(a["bytes"]), a["why"]] for a in arts]))
    return s


def _next_steps(rep: dict[str, Any]) -> Section:
    d = rep.get("dir") or "DIR"
    q = shlex.quote(d)
    name = shlex.quote(d.rstrip("/").rsplit("/", 1)[-1])
    has_engines = any(a["path"].rstrip("/") == "engine" for a in rep.get("artifacts") or [])
    s = Section("Next steps", "next")
    s.blocks.append("TensorRT on this machine (needs TensorRT and an NVIDIA GPU; the plugins build with cmake, "
                    "docs/tensorrt.md):")
    lines = [] if has_engines else [
        "cmake -S plugins -B build/plugins && cmake --build build/plugins -j",
        f"kvexport build-engine {q}/onnx --plugins build/plugins/libkvexport_plugins.so --fp16 --out {q}/engine"]
    lines += [f"kvexport validate {q} --backend tensorrt", f"kvexport profile {q} --backend tensorrt"]
    s.blocks.append(Code("\n".join(lines)))
    s.blocks.append("On a Jetson (engines are specific to the board and its TensorRT: build them there). Copy this "
                    "directory and a kvexport checkout to the board, then run the deploy script there "
                    "(CUDA architecture 87 on Orin, 110 on Thor); it builds the plugins and engines, validates, "
                    "profiles with tegrastats and rewrites this report with the board's numbers beside these:")
    s.blocks.append(Code(f"rsync -a {q} jetson:~/\nssh jetson 'cd kvexport && bash examples/jetson/deploy.sh "
                         f"~/{name} 87'"))
    return s


def _machine(rep: dict[str, Any]) -> Section | None:
    profiles = rep.get("profiles") or {}
    if not profiles:
        return None
    s = Section("Machine", "machine")
    keys = ("cpu_model", "cpu_count", "machine", "platform", "gpu", "jetson", "nv_tegra_release", "python", "torch",
            "torch_threads", "onnxruntime")
    for backend, prof in profiles.items():
        env = prof.get("environment") or {}
        rows = [[k.replace("_", " "), fmt(env[k])] for k in keys if k in env]
        rows += [[k.replace("_", " "), fmt(v)] for k, v in env.items() if k not in keys]
        load = prof.get("machine_load") or {}
        if load:
            rows.append(["CPU cores busy while profiling",
                         f"{fmt(load.get('busy_cores'))} of {load.get('cpu_count')} "
                         f"(this profile {fmt(load.get('own_cores'))}, other processes {fmt(load.get('other_cores'))})"])
            if load.get("load_avg_start") and load.get("load_avg_end"):
                rows.append(["load average (1 min) before → after", f"{load['load_avg_start'][0]:.2f} → "
                                                                    f"{load['load_avg_end'][0]:.2f}"])
        else:
            rows.append(["machine load", "not recorded (profile written by an older kvexport)"])
        if len(profiles) > 1:
            s.blocks.append(f"{backend}:")
        s.blocks.append(Table(["", ""], rows))
    return s


def _studies(rep: dict[str, Any]) -> Section:
    s = Section("Accuracy studies", "accuracy")
    for name, data in rep["studies"].items():
        s.blocks.append(f"{name}:")
        if isinstance(data, dict):
            scal = [[k, fmt(v)] for k, v in data.items() if not isinstance(v, (dict, list))]
            if scal:
                s.blocks.append(Table(["field", "value"], scal))
            for k, v in data.items():
                if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                    keys = list(dict.fromkeys(kk for x in v for kk in x))[:8]
                    s.blocks.append(f"{k}:")
                    s.blocks.append(Table(keys, [[fmt(x.get(kk)) for kk in keys] for x in v[:50]]))
    return s


def _settings(rep: dict[str, Any]) -> Section:
    conv = rep.get("convert") or {}
    s = Section("Model and rewrite settings", "settings")
    if conv.get("model"):
        s.blocks.append(Table(["model field", "value"], [[k, fmt(v)] for k, v in conv["model"].items()]))
    if conv.get("settings"):
        s.blocks.append(Table(["setting", "value"], [[k, fmt(v)] for k, v in conv["settings"].items()]))
    if not conv.get("model") and not conv.get("settings"):
        s.blocks.append("No convert.json in this directory (profiled export only).")
    return s


def _stages(rep: dict[str, Any]) -> Section | None:
    stages = [r for r in (rep.get("convert") or {}).get("stages") or [] if r.get("status") != "pending"]
    if not stages:
        return None
    s = Section("Stages", "stages")
    total = sum(float(r.get("seconds") or 0) for r in stages)
    s.blocks.append(Table(["stage", "status", "wall time (s)", "note"],
                          [[r["name"], r["status"], fmt(r.get("seconds")), r.get("note", "")] for r in stages]
                          + [["total", "", fmt(round(total, 1)), ""]]))
    return s


__all__ = ["build_sections", "fidelity_summary", "profile_warnings", "all_warnings", "SPREAD_WARN", "SLOWER_WARN"]
