"""The seed's reranker (late interaction + choices) and inference, beside the same model in PyTorch.

    python bench/reranker.py                 # depth 12 / hidden 512, 64 queries and 64 documents a step
    python bench/reranker.py --depth 2 --hidden 128 --pairs 8 --device cpu    # a quick look on the CPU

Training: each step holds `pairs` queries of 32 random bytes and as many documents of 511 random
bytes, each document offering the choices "yn" with targets (0.8, 0.2). Query i attracts document
i (both ways) and repels document i + 1. uform runs the seed's reranker configuration (the
contrastive objective, late interaction with RANKED pairs and a 128-wide token head, the choices
term); the peer computes the same function in PyTorch as a user would write it: queries and
documents as two padded batches through one encoder, SigLIP's sigmoid loss over pooled rows with
every unnamed pair repelling, MaxSim over the token head's unit vectors with the ranked pair loss,
and the byte decoder's softmax over "y" and "n" at the position after each document.

Inference: `Encoder.embed`, `embed_tokens` and `text_choose` over `items` texts of 512 bytes
(511 for text_choose, which appends its choice position), beside the peer's module in
`torch.inference_mode` answering the same numbers as host float32 arrays.

Both start from the same weights (a fresh uform trainer's, loaded into the peer), so the first
step's losses and the inference answers are printed side by side as a check that the math agrees.
One JSON line per measurement; the peer runs eager and compiled (eager alone on the CPU).
`torch` must be installed.
"""
import argparse
import importlib.util
import json
import math
import os
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

import uform

QUERY_SPAN, WIDTH, TARGETS = 32, 128, (0.8, 0.2)


def load_peer():
    spec = importlib.util.spec_from_file_location("torch_peer", os.path.join(os.path.dirname(__file__), "torch_peer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reranker_step(pairs, seed=0):
    """One step in uform's words: items 0..pairs-1 are queries, pairs..2 pairs-1 documents."""
    rng = np.random.default_rng(seed)
    queries = [bytes(rng.integers(0, 256, QUERY_SPAN, dtype=np.uint8)) for _ in range(pairs)]
    documents = [bytes(rng.integers(0, 256, 511, dtype=np.uint8)) for _ in range(pairs)]
    attract = [[pairs + i] for i in range(pairs)] + [[i] for i in range(pairs)]
    repel = [[pairs + (i + 1) % pairs] for i in range(pairs)] + [[] for _ in range(pairs)]

    def edges(runs):
        return uform.Edges(offsets=np.cumsum([0] + [len(r) for r in runs]).tolist(), ids=sum(runs, []))

    return dict(
        modalities=[uform.Modality.TEXT] * (2 * pairs), contents=queries + documents,
        sides=[uform.LateInteractionSide.QUERY] * pairs + [uform.LateInteractionSide.DOCUMENT] * pairs,
        choices=[""] * pairs + ["yn"] * pairs,
        choice_targets=[np.zeros(0, np.float32)] * pairs + [np.array(TARGETS, np.float32)] * pairs,
        relations=dict(attract=edges(attract), repel=edges(repel)))


def reranker_config(depth, hidden, pairs):
    rows = pairs + math.ceil(pairs * QUERY_SPAN / 512)
    return dict(depth=depth, hidden=hidden, objective=uform.Objective.CONTRASTIVE, schedule=dict(steps=100000),
                batch=dict(max_rows_per_device=rows, max_columns_per_row=512, max_segments_per_device=2 * pairs,
                           max_choices_per_item=16),
                late_interaction=dict(weight=1, width=WIDTH, max_query_span=QUERY_SPAN,
                                      pair_loss=uform.PairLossForm.RANKED),
                choices=dict(weight=1))


def peer_model(peer, depth, hidden, weights):
    """torch_peer's encoder with uform's RMSNorm epsilon and the reranker's heads, holding `weights`."""
    nn = torch.nn
    model = peer.Encoder(depth, hidden, 512)
    model.token_head = nn.Linear(hidden, WIDTH, bias=False)
    model.late_log_t = nn.Parameter(torch.zeros(()))
    model.late_bias = nn.Parameter(torch.zeros(()))
    names = {"embed.weight": "text.embedding", "norm.weight": "final_norm", "decoder.weight": "text.decoder",
             "token_head.weight": "late_interaction.token_head", "late_log_t": "late_interaction.log_inverse_temperature",
             "late_bias": "late_interaction.bias", "log_inverse_temperature": "contrastive.log_inverse_temperature",
             "bias": "contrastive.bias"}
    for l in range(depth):
        for ours, theirs in (("norm1", "attention_norm"), ("qkv", "qkv"), ("out", "out"), ("norm2", "mlp_norm"),
                             ("up", "up"), ("down", "down")):
            names[f"blocks.{l}.{ours}.weight"] = f"blocks.{l}.{theirs}"
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(torch.from_numpy(weights[names[name]]).reshape(parameter.shape))
    for module in model.modules():
        if isinstance(module, nn.RMSNorm):
            module.eps = 1e-6
    return model


def encode(model, tokens):
    """Final-norm states of a (batch, length) block of ids, positions from 0 in each row."""
    x = model.embed(tokens)
    for block in model.blocks:
        x = block(x, model.cos[:tokens.shape[1]], model.sin[:tokens.shape[1]])
    return model.norm(x)


def peer_loss(model, queries, documents, choice_bytes, targets):
    q, d = encode(model, queries), encode(model, documents)
    pairs = q.shape[0]
    # Pooled sigmoid: every cell repels but the attracting pair and the diagonal, which is ignored.
    z = F.normalize(torch.cat([q.float().mean(1), d.float().mean(1)]), dim=-1)
    scores = z @ z.T * model.log_inverse_temperature.exp() + model.bias
    labels = -torch.ones_like(scores)
    index = torch.arange(pairs, device=z.device)
    labels[index, index + pairs] = labels[index + pairs, index] = 1
    labels.fill_diagonal_(0)
    contrastive = -(F.logsigmoid(labels * scores) * (labels != 0)).sum() / (2 * pairs)
    # MaxSim of each query against its attracted and its repelled document; the choice position takes no part.
    tq = F.normalize(model.token_head(q).float(), dim=-1)
    td = F.normalize(model.token_head(d[:, :-1]).float(), dim=-1)
    named = td[torch.stack([index, (index + 1) % pairs], 1)]  # (pairs, 2, length, width)
    maxsim = torch.einsum("qtw,qkuw->qktu", tq, named).amax(-1).sum(-1)
    s = maxsim * model.late_log_t.exp() + model.late_bias
    late = F.softplus(s[:, 1] - s[:, 0]).mean()
    logits = model.decoder(d[:, -1]).float()[:, choice_bytes]
    choices = -(targets * F.log_softmax(logits, -1)).sum(-1).mean()
    return contrastive + late + choices, (contrastive, late, choices)


def tensors(step, pairs, device):
    queries = torch.tensor(np.frombuffer(b"".join(step["contents"][:pairs]), np.uint8).reshape(pairs, -1), device=device)
    documents = np.frombuffer(b"".join(step["contents"][pairs:]), np.uint8).reshape(pairs, -1).astype(np.int64)
    documents = torch.tensor(np.concatenate([documents, np.full((pairs, 1), 257)], 1), device=device)
    return queries.long(), documents, torch.tensor([ord("y"), ord("n")], device=device), \
        torch.tensor(TARGETS, device=device)


def flops(depth, hidden, pairs):
    """6 x the products' parameters per token plus attention, forward and backward."""
    tokens = pairs * (QUERY_SPAN + 512)
    per_token = 6 * (depth * 12 * hidden * hidden + 256 * hidden + WIDTH * hidden)
    attention = 12 * depth * hidden * pairs * (QUERY_SPAN ** 2 + 512 ** 2)
    return tokens * per_token + attention


def train(args, peer, executor, init, weights, path, peak):
    step = reranker_step(args.pairs)
    tokens = args.pairs * (QUERY_SPAN + 512)
    results = []
    with init(executor, reranker_config(args.depth, args.hidden, args.pairs)) as trainer:
        first = trainer.step(step).stats
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                start = time.perf_counter()
            stats = trainer.step(step).stats
        seconds = (time.perf_counter() - start) / args.steps
    results.append(dict(peer="uform", step_ms=seconds * 1e3, tokens_per_s=tokens / seconds,
                        first_losses=[first.contrastive_loss, first.late_interaction_loss, first.choices_loss],
                        last_loss=stats.loss))
    gpu = args.device == "cuda"
    for mode in ("eager", "compile") if gpu else ("eager",):
        model = peer_model(peer, args.depth, args.hidden, weights).to(args.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=gpu)
        loss_fn = torch.compile(peer_loss) if mode == "compile" else peer_loss
        batch = tensors(step, args.pairs, args.device)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        for i in range(1 + args.warmup + args.steps):
            if i == 1 + args.warmup:
                sync(gpu)
                start = time.perf_counter()
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=gpu):
                loss, terms = loss_fn(model, *batch)
            if i == 0:
                first_losses = [t.item() for t in terms]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync(gpu)
        seconds = (time.perf_counter() - start) / args.steps
        results.append(dict(peer="torch", mode=mode, step_ms=seconds * 1e3, tokens_per_s=tokens / seconds,
                            first_losses=first_losses, last_loss=loss.item(),
                            peak_memory_bytes=torch.cuda.max_memory_allocated() if gpu else None))
    for result in results:
        result.update(task="train", depth=args.depth, hidden=args.hidden, pairs=args.pairs,
                      mfu=flops(args.depth, args.hidden, args.pairs) / (result["step_ms"] / 1e3) / 1e12 / peak
                      if peak else None)
        print(json.dumps(result), flush=True)
    print(json.dumps(dict(task="train", ratio_to_best_peer=min(r["step_ms"] for r in results[1:]) / results[0]["step_ms"])))


def sync(gpu):
    if gpu:
        torch.cuda.synchronize()


def infer(args, peer, executor, weights, path):
    rng = np.random.default_rng(1)
    texts = [bytes(rng.integers(0, 256, 512, dtype=np.uint8)) for _ in range(args.items)]
    short = [t[:511] for t in texts]
    kinds = [uform.Modality.TEXT] * args.items
    gpu = args.device == "cuda"
    chunk = args.pairs  # the peer's batch: as many rows as a uform pass holds
    answers = {}
    with uform.Encoder.load(path, executor) as encoder:
        verbs = dict(embed=lambda: encoder.embed(kinds, texts).numpy(),
                     embed_tokens=lambda: encoder.embed_tokens(kinds, texts),
                     text_choose=lambda: encoder.text_choose(short, ["yn"] * args.items))
        for verb, call in verbs.items():
            answers[verb] = call()
            start = time.perf_counter()
            for _ in range(args.repeats):
                call()
            seconds = (time.perf_counter() - start) / args.repeats
            print(json.dumps(dict(task=verb, peer="uform", items=args.items, items_per_s=args.items / seconds)), flush=True)
    ids = torch.tensor(np.frombuffer(b"".join(texts), np.uint8).reshape(args.items, 512).astype(np.int64))
    choice_ids = torch.cat([ids[:, :511], torch.full((args.items, 1), 257)], 1)
    model = peer_model(peer, args.depth, args.hidden, weights).to(args.device).eval()

    def embed(x):
        return F.normalize(encode(model, x).float().mean(1), dim=-1)

    def embed_tokens(x):
        return F.normalize(model.token_head(encode(model, x)).float(), dim=-1)

    def text_choose(x):
        return model.decoder(encode(model, x)[:, -1]).float()[:, [ord("y"), ord("n")]].softmax(-1)

    for mode in ("eager", "compile") if gpu else ("eager",):
        for verb, function, inputs in (("embed", embed, ids), ("embed_tokens", embed_tokens, ids),
                                       ("text_choose", text_choose, choice_ids)):
            compiled = torch.compile(function) if mode == "compile" else function

            def call():
                with torch.inference_mode(), torch.autocast(args.device, dtype=torch.bfloat16, enabled=gpu):
                    return torch.cat([compiled(inputs[i:i + chunk].to(args.device)).cpu()
                                      for i in range(0, args.items, chunk)]).numpy()

            theirs = call()
            start = time.perf_counter()
            for _ in range(args.repeats):
                call()
            seconds = (time.perf_counter() - start) / args.repeats
            ours = answers[verb]
            ours = np.concatenate(list(ours)) if isinstance(ours, list) else ours
            theirs = theirs.reshape(ours.shape)
            print(json.dumps(dict(task=verb, peer="torch", mode=mode, items=args.items, items_per_s=args.items / seconds,
                                  largest_difference=float(np.abs(ours - theirs).max()))), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=64, help="queries (and documents) a step")
    parser.add_argument("--items", type=int, default=1024, help="texts each inference verb answers")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    peer = load_peer()
    from safetensors.numpy import load_file

    gpu = args.device == "cuda"
    peak = peer.peak_bf16_tflops() if gpu else None
    executor = uform.Executor.for_vram() if gpu else uform.Executor.for_ram()
    init = uform.Trainer.init_vram if gpu else uform.Trainer.init_ram
    with executor, tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "reranker.safetensors")
        with init(executor, reranker_config(args.depth, args.hidden, args.pairs)) as trainer:
            trainer.save(path, weights_only=True)
        weights = load_file(path)
        train(args, peer, executor, init, weights, path, peak)
        infer(args, peer, executor, weights, path)


if __name__ == "__main__":
    main()
