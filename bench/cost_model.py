#!/usr/bin/python3
"""Predicts the gradient exchange time per training step on GPUs (issue 44, item 7): fp32, bf16,
NCCL's native fp8 all-reduce, GeoFP8 fp8 and nvfp4, for Llama-600M on 64 GH200 and on H100 nodes.

No GPU has run tests/gpu/run.sh yet, so every GPU rate here is a published bandwidth or FLOP rate
times a fraction the issue sets as a target: an assumption until that check measures it. The
only measured kernel rates are the CPU ones in docs/benchmarks.md, printed for reference and not
used in the prediction. Stdlib only, deterministic; see docs/benchmarks.md "GPU cost model".

The model, per optimizer step (P gradient elements, M of them in weight matrices, N = G nodes x
g GPUs per node, the gradient in buckets of `--bucket-mib` MiB of fp32, one collective call per
bucket):

  ring all-reduce of S bytes: 2(N-1)/N S sent per GPU; of it 1/g crosses the node's network
    (each GPU owns one NIC and one of g rings' node-crossing edges, as NCCL lays its channels),
    the rest goes over NVLink. Time = max(NVLink bytes / B_nvl, network bytes / B_ib) (the ring
    pipelines both) + 2[(G-1) a_ib + (N-G) a_nvl] (only node-crossing steps pay the network's
    latency). Tree: the same bytes as 2S, latency 2[ceil(log2 G) a_ib + ceil(log2 g) a_nvl].
    The all-reduce takes the faster of the two, as NCCL's tuner would.
  ring all-gather of S bytes (the output): half the all-reduce's bytes and latency; with one GPU
    a node, NCCL >= 2.23's PAT schedule, ceil(log2 N) a_ib, where that is lower.
  all-to-all of S bytes: (N-1)/N S sent; (g-1)/N S over NVLink, (N-g)/N S over the network
    (every off-node chunk leaves through the GPU's own NIC); latency a_far + (N-1) a_peer.
  codec: HBM bytes read + written / (HBM x memcpy_eff x fraction), fraction = the issue's
    encode target (decode and the fused sum-requantize assumed at the same fraction).
  lowrank transform: max(16 k M (1 + sketch) FLOPs / (transform_frac x FP32 rate),
    (1 + sketch) 24 M bytes / (HBM x memcpy_eff)): at rank 8 the thin GEMMs are memory-bound.
  backward = 2/3 of 6 P T / (BF16 peak x mfu), T = global_tokens / N tokens per GPU and step.
  exposed = codec + max(last bucket's wire time, wire - backward): wire time hides behind the
    backward pass, except the last bucket's; the codec runs on the same SMs and HBM as backward,
    so it is not hidden (--hide-codec: exposed = max(last bucket's total, total - backward)).
"""
import argparse
import math
import sys

# kernels/model/model.cc PresetConfig("llama-600m") and ParamLayout; vocab 256 is the project's
# byte-level tokenizer (model.h), so the embedding and head are small.
MODEL = dict(name="llama-600m", dim=1536, layers=21, ffn=4096, vocab=256)


def tensors(model=MODEL):
    """(rows, cols) of every gradient tensor; a vector has rows 1."""
    d, f, v = model["dim"], model["ffn"], model["vocab"]
    out = [(v, d)]
    for _ in range(model["layers"]):
        out += [(1, d), (d, d), (d, d), (d, d), (d, d), (1, d), (f, d), (f, d), (d, f)]
    out += [(1, d), (v, d)]
    return out


def encoded_bytes(fmt, n):
    """Wire bytes of n elements of one tensor, scales included (DESIGN.md section 3)."""
    if fmt == "fp32":
        return 4 * n
    if fmt == "bf16":
        return 2 * n
    if fmt == "fp8_native":  # one scale for all ranks, agreed by a max-reduce, not in the payload
        return n
    if fmt == "fp8_block128":  # E4M3 codes + one fp32 scale per 128 elements
        return n + 4 * math.ceil(n / 128)
    if fmt == "nvfp4":  # two E2M1 codes a byte + one E4M3 scale per 16 + one fp32 per tensor
        return math.ceil(n / 2) + math.ceil(n / 16) + 4
    raise ValueError(f"unknown format {fmt}")


# Setups. Each source says where a figure comes from: published (a datasheet, named) or
# assumption (not measured anywhere here).
SETUPS = {
    "gh200": dict(
        title="(a) Llama-600M data-parallel on 64 GH200: 64 nodes x 1 superchip, 1x400 Gb/s NDR "
              "InfiniBand each",
        nodes=64, gpus_per_node=1, nvlink_gbs=0.0, ib_gbps=400.0, hbm_tbs=4.0,
        bf16_tflops=989.0, fp32_tflops=67.0, gpu="GH200 (H100-class GPU, 96 GB HBM3)"),
    "h100x8": dict(
        title="(b) 8 nodes x 8 H100 SXM (64 GPUs): NVLink 4 via NVSwitch within a node, 1x400 "
              "Gb/s InfiniBand per GPU across nodes",
        nodes=8, gpus_per_node=8, nvlink_gbs=450.0, ib_gbps=400.0, hbm_tbs=3.35,
        bf16_tflops=989.0, fp32_tflops=67.0, gpu="H100 SXM 80 GB HBM3"),
    "h100x1": dict(
        title="(b') 1 node x 8 H100 SXM: NVLink 4 via NVSwitch only",
        nodes=1, gpus_per_node=8, nvlink_gbs=450.0, ib_gbps=400.0, hbm_tbs=3.35,
        bf16_tflops=989.0, fp32_tflops=67.0, gpu="H100 SXM 80 GB HBM3"),
}

# Inputs shared by the setups: flag -> (default, kind, source). kind: "pos" > 0, "frac" in
# (0, 1], "nonneg" >= 0, "int" >= 1.
INPUTS = {
    "link_eff": (0.8, "frac", "assumption: a large NCCL collective reaches 0.8 of each link's "
                 "line rate (scripts/projection.py measured 0.8 for Gloo over TCP, CPU)"),
    "memcpy_eff": (0.9, "frac", "assumption: a D2D memcpy moves read + write bytes at 0.9 of the "
                   "published HBM bandwidth"),
    "encode_fp8": (0.85, "frac", "assumption = issue 44 target: fp8 e4m3 block 128 encode >= "
                   "0.85x D2D memcpy (decode and sum-requantize assumed the same)"),
    "encode_nvfp4": (0.70, "frac", "assumption = issue 44 target: nvfp4 encode >= 0.7x D2D "
                     "memcpy (decode and sum-requantize assumed the same)"),
    "cast_frac": (1.0, "frac", "assumption: an fp32<->bf16 cast streams at memcpy rate"),
    "transform_frac": (0.5, "frac", "assumption = issue 44 target: lowrank apply + inverse >= "
                       "0.5x a cuBLAS sgemm of equal FLOPs, sgemm taken at the published FP32 "
                       "(non-tensor-core) peak, not TF32"),
    "rank": (8, "int", "policy: lowrank rank 8 (the geofp8 preset, as scripts/projection.py)"),
    "sketch": (1.0, "nonneg", "assumption: the factor-sketch update costs one more apply + "
               "inverse per step (scripts/projection.py geo_flop_factor 2); 0 leaves it out"),
    "mfu": (0.4, "frac", "assumption: model FLOP utilisation of the BF16 GEMMs (as "
            "scripts/projection.py)"),
    "global_tokens": (524288, "int", "assumption: 0.5 Mi tokens per optimizer step, fixed global "
                      "batch (as scripts/projection.py); per GPU = global / N"),
    "bucket_mib": (25.0, "pos", "assumption: PyTorch DDP's default bucket_cap_mb = 25, one "
                   "collective call (or two_phase pair) per bucket"),
    "alpha_nvlink_us": (1.0, "nonneg", "assumption: latency per NVLink ring step"),
    "alpha_ib_us": (5.0, "nonneg", "assumption: latency per InfiniBand ring step"),
    "alpha_peer_us": (0.5, "nonneg", "assumption: all-to-all issue cost per peer (grouped "
                      "send/recv)"),
}
# Per-setup inputs that the command line may override for every selected setup.
SETUP_FLAGS = {
    "nodes": "int", "gpus_per_node": "int", "nvlink_gbs": "nonneg", "ib_gbps": "pos",
    "hbm_tbs": "pos", "bf16_tflops": "pos", "fp32_tflops": "pos",
}

SOURCES = [
    ("H100 SXM: HBM3 3.35 TB/s, NVLink 4 900 GB/s total = 450 GB/s per direction, FP32 67 "
     "TFLOP/s, dense BF16 989 TFLOP/s", "published: NVIDIA H100 Tensor Core GPU datasheet (SXM "
     "column)"),
    ("GH200: HBM3 4 TB/s (the 96 GB HBM3 part; the 144 GB HBM3e part has 4.9 TB/s, "
     "--hbm-tbs 4.9), FP32 67 TFLOP/s, dense BF16 989 TFLOP/s; NVLink-C2C (900 GB/s) joins the "
     "Grace CPU to its own GPU and is not a GPU-GPU link", "published: NVIDIA GH200 Grace Hopper "
     "Superchip datasheet"),
    ("GH200 network: one 400 Gb/s NDR InfiniBand port per superchip (ConnectX-7), one superchip "
     "per node; the paper does not say its network. CSCS Alps (HPE Cray EX254n, 4 GH200 a node, "
     "one 200 Gb/s Slingshot-11 NIC per GH200) is the other common layout: --setup gh200 "
     "--ib-gbps 200 models its network side", "published: NVIDIA ConnectX-7 adapter and "
     "Quantum-2 NDR InfiniBand product briefs (400 Gb/s per port); HPE Cray EX254n blade spec"),
    ("H100 nodes across nodes: one 400 Gb/s InfiniBand NIC per GPU (8 per node, rail-aligned)",
     "published: NVIDIA DGX H100 user guide (8x ConnectX-7 400 Gb/s for the compute fabric)"),
]

# The only measured kernel rates (CPU, docs/benchmarks.md); not inputs of the GPU prediction.
CPU_MEASURED = [
    ("fp8 e4m3 block 128 encode / memcpy", "0.73 (AVX2, 1 thread, 2-vCPU Intel Xeon VM, median "
     "of 3); 0.79-0.89 (AVX-512, 2-vCPU AMD EPYC Zen 5 VM)"),
    ("fp8 e4m3 block 128 decode / memcpy", "0.64 (AVX2, Intel Xeon VM, loaded)"),
    ("nvfp4 encode / memcpy", "0.39-0.44 (AVX-512, AMD EPYC Zen 5 VM); 0.16 (AVX2, Intel Xeon)"),
    ("lowrank apply + inverse / sgemm of equal FLOPs", "0.54-1.57, k 8..64, shapes to 4096x4096 "
     "(1 OpenBLAS thread, AMD EPYC VM)"),
    ("two_phase fp8 exchange / fp32 ring, 4 ranks, 1 Gbit/s", "0.291 at 0.258 of the bytes "
     "(Gloo over shaped veth, 2-core VM)"),
]

METHODS = [  # key, label
    ("fp32", "fp32 all-reduce (NCCL)"),
    ("bf16", "bf16 all-reduce (NCCL, cast from fp32)"),
    ("native", "native fp8 all-reduce (NCCL >= 2.24, per-tensor scale)"),
    ("fp8", "GeoFP8 fp8 e4m3 block 128, two_phase"),
    ("fp8_lowrank", "GeoFP8 fp8 e4m3 block 128, two_phase + lowrank"),
    ("nvfp4", "GeoFP8 nvfp4, two_phase"),
    ("fp8_2level", "GeoFP8 fp8, two_phase in 2 levels (not built)"),
]


class Topo:
    def __init__(self, s, x):
        self.g, self.G = s["gpus_per_node"], s["nodes"]
        self.N = self.g * self.G
        self.b_nvl = s["nvlink_gbs"] * 1e9 * x["link_eff"]
        self.b_ib = s["ib_gbps"] / 8 * 1e9 * x["link_eff"]
        self.a_nvl = x["alpha_nvlink_us"] * 1e-6
        self.a_ib = x["alpha_ib_us"] * 1e-6
        self.a_peer = x["alpha_peer_us"] * 1e-6

    def split(self, sent, nvl_share):
        """(nvlink bytes, network bytes) of `sent` bytes per GPU."""
        if self.G == 1:
            return sent, 0.0
        if self.g == 1:
            return 0.0, sent
        return sent * nvl_share, sent * (1 - nvl_share)

    def bw_time(self, nvl, ib):
        t = 0.0
        if nvl > 0:
            t = max(t, nvl / self.b_nvl)
        if ib > 0:
            t = max(t, ib / self.b_ib)
        return t

    def ring_latency(self, passes):
        return passes * ((self.G - 1) * self.a_ib + (self.N - self.G) * self.a_nvl)

    def allreduce(self, S):
        """(seconds, bytes sent, network bytes) of one all-reduce of S bytes."""
        if self.N == 1:
            return 0.0, 0.0, 0.0
        sent = 2 * (self.N - 1) / self.N * S
        nvl, ib = self.split(sent, (self.g - 1) / self.g)
        ring = self.bw_time(nvl, ib) + self.ring_latency(2)
        tree = (self.bw_time(nvl * self.N / (self.N - 1), ib * self.N / (self.N - 1)) +
                2 * (math.ceil(math.log2(self.G)) * self.a_ib +
                     math.ceil(math.log2(self.g)) * self.a_nvl))
        return min(ring, tree), sent, ib

    def allgather(self, S):
        if self.N == 1:
            return 0.0, 0.0, 0.0
        sent = (self.N - 1) / self.N * S
        nvl, ib = self.split(sent, (self.g - 1) / self.g)
        latency = self.ring_latency(1)
        if self.g == 1:  # NCCL >= 2.23's PAT all-gather (1 GPU a node): log2(N) network steps
            latency = min(latency, math.ceil(math.log2(self.N)) * self.a_ib)
        return self.bw_time(nvl, ib) + latency, sent, ib

    def alltoall(self, S):
        if self.N == 1:
            return 0.0, 0.0, 0.0
        sent = (self.N - 1) / self.N * S
        nvl, ib = self.split(sent, (self.g - 1) / (self.N - 1))
        far = self.a_ib if self.G > 1 else self.a_nvl
        return self.bw_time(nvl, ib) + far + (self.N - 1) * self.a_peer, sent, ib


def total_bytes(fmt, model=MODEL):
    return sum(encoded_bytes(fmt, r * c) for r, c in tensors(model))


def predict(setup, x, model=MODEL, hide_codec=False):
    """Rows of the table for one setup: dict per method (seconds and bytes per GPU and step)."""
    s = setup
    t = Topo(s, x)
    ts = tensors(model)
    P = sum(r * c for r, c in ts)
    M = sum(r * c for r, c in ts if r > 1)
    nb = math.ceil(4 * P / (x["bucket_mib"] * 2**20))
    hbm = s["hbm_tbs"] * 1e12 * x["memcpy_eff"]  # a D2D memcpy's read + write bytes per second
    tokens = x["global_tokens"] / t.N
    compute = 6 * P * tokens / (s["bf16_tflops"] * 1e12 * x["mfu"])
    backward = 2 / 3 * compute
    e8 = total_bytes("fp8_block128", model)
    e4 = total_bytes("nvfp4", model)

    def two_phase(E):
        a, sa, ia = t.alltoall(E / nb)
        g, sg, ig = t.allgather(E / nb)
        return (a + g) * nb, (sa + sg) * nb, (ia + ig) * nb, a + g

    def codec_two_phase(E, frac):
        # encode (read fp32, write codes), sum-requantize (read the N parts of this rank's shard,
        # write its codes), decode the all-gathered codes (read codes, write fp32).
        return (4 * P + E + E + E / t.N + E + 4 * P) / (hbm * frac)

    rows = {}
    for key, _ in METHODS:
        if key in ("fp32", "bf16", "native"):
            S = {"fp32": 4 * P, "bf16": 2 * P, "native": total_bytes("fp8_native", model)}[key]
            one, sent, ib = t.allreduce(S / nb)
            wire, last = one * nb, one
            sent, ib = sent * nb, ib * nb
            if key == "fp32":
                codec = 0.0
            elif key == "bf16":
                codec = (4 * P + 2 * P + 2 * P + 4 * P) / (hbm * x["cast_frac"])
            else:
                # amax pass (read fp32), scale and cast (read fp32, write codes), decode; the
                # common scale is a max-reduce of one word per bucket (tree latency).
                codec = (4 * P + 4 * P + S + S + 4 * P) / (hbm * x["encode_fp8"])
                if t.N > 1:
                    tiny = 2 * (math.ceil(math.log2(t.G)) * t.a_ib +
                                math.ceil(math.log2(t.g)) * t.a_nvl)
                    wire += tiny * nb
                    last += tiny
        elif key in ("fp8", "fp8_lowrank", "nvfp4"):
            E = e4 if key == "nvfp4" else e8
            frac = x["encode_nvfp4"] if key == "nvfp4" else x["encode_fp8"]
            wire, sent, ib, last = two_phase(E)
            codec = codec_two_phase(E, frac)
            if key == "fp8_lowrank":
                codec += transform_time(s, x, M)[0]
        else:  # fp8_2level: only where there are both NVLink peers and other nodes
            if t.g == 1 or t.G == 1:
                continue
            intra = Topo(dict(s, nodes=1), x)
            inter = Topo(dict(s, gpus_per_node=1), x)
            a1, s1, _ = intra.alltoall(e8 / nb)
            a2, s2, i2 = inter.alltoall(e8 / nb / t.g)
            g2, s3, i3 = inter.allgather(e8 / nb / t.g)
            g1, s4, _ = intra.allgather(e8 / nb)
            last = a1 + a2 + g2 + g1
            wire, sent, ib = last * nb, (s1 + s2 + s3 + s4) * nb, (i2 + i3) * nb
            # one more sum-requantize, at the node level (reads g parts of a 1/g shard)
            codec = (codec_two_phase(e8, x["encode_fp8"]) +
                     (e8 / t.g + e8 / t.N) / (hbm * x["encode_fp8"]))
        if t.N == 1:  # nothing to exchange, nothing to encode
            wire = last = codec = sent = ib = 0.0
        total = wire + codec
        if hide_codec:
            last_total = last + codec / nb
            exposed = max(last_total, total - backward) if t.N > 1 else 0.0
        else:
            exposed = codec + (max(last, wire - backward) if t.N > 1 else 0.0)
        rows[key] = dict(sent=sent, ib=ib, wire=wire, codec=codec, total=total, exposed=exposed)
    meta = dict(P=P, M=M, N=t.N, buckets=nb, tokens=tokens, compute=compute, backward=backward,
                transform=transform_time(s, x, M))
    return rows, meta


def transform_time(s, x, M):
    """(seconds, FLOP-bound seconds, memory-bound seconds) of lowrank apply + inverse (+ sketch)."""
    reps = 1 + x["sketch"]
    flop = 16 * x["rank"] * M * reps / (x["transform_frac"] * s["fp32_tflops"] * 1e12)
    mem = 24 * M * reps / (s["hbm_tbs"] * 1e12 * x["memcpy_eff"])
    return max(flop, mem), flop, mem


def verdict(rows, meta, s):
    """Plain sentences: where GeoFP8 can win in this setup and where it cannot."""
    out = []
    f8, bf, nat, lr, nv = (rows[k] for k in ("fp8", "bf16", "native", "fp8_lowrank", "nvfp4"))
    for name, r in (("fp8", f8), ("fp8 + lowrank", lr), ("nvfp4", nv)):
        beats = [peer for peer in ("fp32", "bf16", "native")
                 if r["exposed"] < rows[peer]["exposed"]]
        out.append(f"- GeoFP8 {name}: exposed {ms(r['exposed'])} ms against fp32 "
                   f"{ms(rows['fp32']['exposed'])}, bf16 {ms(bf['exposed'])} and native fp8 "
                   f"{ms(nat['exposed'])}: "
                   + ("beats " + ", ".join(beats) if beats else "beats none of them") + ".")
    out.append(f"- Not overlapped: GeoFP8 fp8 takes {ms(f8['total'])} ms (wire {ms(f8['wire'])} + "
               f"codec {ms(f8['codec'])}, the codec {f8['codec'] / max(f8['total'], 1e-30):.0%} of "
               f"it) against fp32 {ms(rows['fp32']['total'])}, bf16 {ms(bf['total'])} and native "
               f"fp8 {ms(nat['total'])}; nvfp4 {ms(nv['total'])}.")
    tr = meta["transform"]
    out.append(f"- The lowrank transform (rank {s['rank']}) adds {ms(tr[0])} ms "
               f"({'memory' if tr[2] >= tr[1] else 'FLOP'}-bound: {ms(tr[2])} ms of HBM traffic, "
               f"{ms(tr[1])} ms at the FLOP target), {tr[0] / max(f8['total'], 1e-30):.2f}x "
               f"GeoFP8 fp8's own exchange.")
    if "fp8_2level" in rows:
        r2 = rows["fp8_2level"]
        out.append(f"- Flat two_phase sends {mb(f8['ib'])} MB a GPU over InfiniBand against "
                   f"{mb(rows['fp32']['ib'])} MB for an fp32 ring: its all-to-all sends every "
                   f"off-node chunk through the NIC. A 2-level two_phase (not built) would send "
                   f"{mb(r2['ib'])} MB and expose {ms(r2['exposed'])} ms.")
    return out


def ms(sec):
    return f"{sec * 1e3:.2f}"


def mb(b):
    return f"{b / 1e6:.0f}"


def render(name, s, x, hide_codec):
    rows, meta = predict(s, x, hide_codec=hide_codec)
    lines = [f"## {s['title']}", ""]
    lines.append(f"{meta['N']} GPUs ({s['nodes']} node(s) x {s['gpus_per_node']}), {s['gpu']}; "
                 f"HBM {s['hbm_tbs']} TB/s, NVLink {s['nvlink_gbs']:g} GB/s per direction, "
                 f"network {s['ib_gbps']:g} Gb/s per GPU; {meta['buckets']} buckets per step; "
                 f"{meta['tokens']:.0f} tokens per GPU and step: compute {ms(meta['compute'])} "
                 f"ms, of which backward {ms(meta['backward'])} ms.")
    lines.append("")
    lines.append("| method | MB sent per GPU per step | of which over IB | wire ms | codec ms | "
                 "total ms | exposed ms |")
    lines.append("|---|---|---|---|---|---|---|")
    for key, label in METHODS:
        if key not in rows:
            continue
        r = rows[key]
        lines.append(f"| {label} | {mb(r['sent'])} | {mb(r['ib'])} | {ms(r['wire'])} | "
                     f"{ms(r['codec'])} | {ms(r['total'])} | {ms(r['exposed'])} |")
    lines.append("")
    lines += verdict(rows, meta, dict(s, rank=x["rank"]))
    return lines


def positive_check(flag, kind, v):
    ok = {"pos": v > 0, "frac": 0 < v <= 1, "nonneg": v >= 0, "int": v >= 1}[kind]
    want = {"pos": "> 0", "frac": "in (0, 1]", "nonneg": ">= 0", "int": "an integer >= 1"}[kind]
    return ok and math.isfinite(v), want


def parse(argv):
    p = argparse.ArgumentParser(
        prog="cost_model.py",
        description="Predicts the gradient exchange time per training step (fp32, bf16, native "
                    "fp8, GeoFP8 fp8 and nvfp4) from published GPU and link rates and the issue "
                    "44 kernel targets. Prints one markdown table per setup.",
        epilog="Every value flag overrides the default printed in the inputs table; setup flags "
               "(--nodes, --ib-gbps, ...) apply to every selected setup.")
    p.add_argument("--setup", default="gh200,h100x8,h100x1",
                   help="comma list of " + ", ".join(SETUPS) + " (default: all three)")
    p.add_argument("--hide-codec", action="store_true",
                   help="let the codec hide behind backward too (optimistic)")
    p.add_argument("--no-inputs", action="store_true", help="print the tables only")
    for name, kind in SETUP_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, metavar="V", default=None,
                       help=f"override every selected setup's {name}")
    for name, (default, kind, source) in INPUTS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, metavar="V", default=None,
                       help=f"{source} (default {default})")
    a = p.parse_args(argv)

    def value(name, text, kind):
        flag = "--" + name.replace("_", "-")
        try:
            v = int(text) if kind == "int" else float(text)
        except ValueError:
            p.error(f"{flag}: not a{'n integer' if kind == 'int' else ' number'} ({text})")
        ok, want = positive_check(flag, kind, v)
        if not ok:
            p.error(f"{flag}: must be {want} ({text})")
        return v

    x = {k: v[0] for k, v in INPUTS.items()}
    for name, (_, kind, _) in INPUTS.items():
        if getattr(a, name) is not None:
            x[name] = value(name, getattr(a, name), kind)
    overrides = {}
    for name, kind in SETUP_FLAGS.items():
        if getattr(a, name) is not None:
            overrides[name] = value(name, getattr(a, name), kind)
    names = [n for n in a.setup.split(",") if n]
    if not names or any(n not in SETUPS for n in names):
        p.error(f"--setup: each must be one of {', '.join(SETUPS)} ({a.setup})")
    setups = []
    for n in names:
        s = dict(SETUPS[n], **overrides)
        if s["gpus_per_node"] > 1 and s["nodes"] * s["gpus_per_node"] > 1 and \
                s["nvlink_gbs"] <= 0:
            p.error(f"--nvlink-gbs: must be > 0 with {s['gpus_per_node']} GPUs per node "
                    f"({s['nvlink_gbs']:g})")
        setups.append((n, s))
    return a, x, setups


def main(argv=None):
    a, x, setups = parse(sys.argv[1:] if argv is None else argv)
    out = []
    if not a.no_inputs:
        ts = tensors()
        P = sum(r * c for r, c in ts)
        out.append(f"model {MODEL['name']}: {P:,} gradient elements in {len(ts)} tensors, "
                   f"{sum(r * c for r, c in ts if r > 1):,} in weight matrices "
                   f"(kernels/model/model.cc); wire bytes per element: fp32 4, bf16 2, native fp8 "
                   f"1, fp8 block 128 {total_bytes('fp8_block128') / P:.5f}, nvfp4 "
                   f"{total_bytes('nvfp4') / P:.5f}")
        out.append("")
        out.append("| input | value | source |")
        out.append("|---|---|---|")
        for name, (_, _, source) in INPUTS.items():
            out.append(f"| {name} | {x[name]:g} | {source} |")
        for fig, source in SOURCES:
            out.append(f"| {fig} | | {source} |")
        out.append("")
        out.append("Measured on CPU only (docs/benchmarks.md), not used above:")
        for what, val in CPU_MEASURED:
            out.append(f"- {what}: {val}")
        out.append("")
    for n, s in setups:
        out += render(n, s, x, a.hide_codec)
        out.append("")
    print("\n".join(out).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
