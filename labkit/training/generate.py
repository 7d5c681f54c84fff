"""Text from a trained model on CPU: greedy, temperature and top-k sampling, seeded.

mindformers' `generate()` fails on CPU (kernel ArgMaxExt is not registered), so this sampler runs full forward
passes over a fixed window of `window` tokens: the context (prompt, then generated tokens), then filler that the
causal mask keeps out of every position that is read. One compiled graph serves every step; the next token comes
from the logits at the last context position. When the context outgrows the window, only its last `window` tokens
are kept (the model never saw positions past its training length anyway).

The model is built with pad_token_id = -1: mindformers' mask also hides every key whose id equals pad_token_id,
which HF does not do, so greedy tokens here equal `transformers`' greedy `generate()` on the same weights.

A prompt is encoded without BOS and preceded by EOS: the training data separates documents with EOS only, so text
after an EOS is the start of a document.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from labkit.config import ModelConfig, RunConfig, load
from labkit.data.dataset import load_fast_tokenizer
from labkit.errors import LabkitError
from labkit.logs import quiet_mindformers
from labkit.model.llama import build_model
from labkit.output import emit
from labkit.paths import lab_path
from labkit.training import checkpoint, run_dir
from labkit.weights.convert import run_tokenizer


def pick_token(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """Next token from one row of logits: argmax when temperature is 0 (or top_k is 1), else a draw from
    softmax(logits / temperature) restricted to the top_k most likely tokens (0 = all)."""
    if temperature <= 0 or top_k == 1:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    return int(rng.choice(z.size, p=p / p.sum()))


class Sampler:
    """A mindformers Llama in inference mode over a fixed window; weights set with `load()`."""

    def __init__(self, model_cfg: ModelConfig, window: int):
        quiet_mindformers()

        if not 1 < window <= model_cfg.max_position_embeddings:
            raise LabkitError(f"generation window {window} must be in 2..{model_cfg.max_position_embeddings}")
        self.cfg, self.window = model_cfg, window
        self.model = build_model(dataclasses.replace(model_cfg, pad_token_id=-1), seq_length=window, no_init=True)
        self.model.set_train(False)
        self.params = dict(self.model.parameters_and_names())

    def load(self, weights: dict) -> None:
        """Copy weights ({name: numpy array or Tensor}) into the sampler's model; names and shapes must match."""
        import mindspore as ms

        missing = sorted(set(self.params) - set(weights))
        if missing:
            raise LabkitError(f"the weights lack {missing[:3]} ({len(missing)} in all)",
                              "give a checkpoint of the same model (model preset and vocab size)")
        for name, p in self.params.items():
            w = weights[name]
            w = w.asnumpy() if hasattr(w, "asnumpy") else np.asarray(w)
            if tuple(w.shape) != tuple(p.shape):
                raise LabkitError(f"{name}: weights {list(w.shape)}, model {list(p.shape)}",
                                  "give a checkpoint of the same model")
            p.set_data(ms.Tensor(w.astype(np.float32)))

    def next_logits(self, context: list[int]) -> np.ndarray:
        import mindspore as ms

        ctx = context[-self.window:]
        buf = np.zeros((1, self.window), np.int32)
        buf[0, :len(ctx)] = ctx
        # the Cell itself, not an @ms.jit closure over it: such a closure keeps the weights it was compiled with
        # and ignores a later set_data (MindSpore 2.9, measured)
        out = self.model(ms.Tensor(buf))[0].asnumpy().reshape(self.window, -1)
        return out[len(ctx) - 1]

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                     seed: int = 0, stop_id: int | None = None) -> list[int]:
        """New token ids after `prompt_ids` (at most max_new_tokens; stops after `stop_id` if given)."""
        if not prompt_ids:
            raise LabkitError("the prompt has no tokens", "give a prompt (the EOS before it counts as one)")
        if max_new_tokens < 0 or temperature < 0 or top_k < 0:
            raise LabkitError("--max-new-tokens, --temperature and --top-k must be >= 0")
        rng = np.random.default_rng(seed)
        context, new = list(prompt_ids), []
        for _ in range(max_new_tokens):
            tok = pick_token(self.next_logits(context), temperature, top_k, rng)
            new.append(tok)
            context.append(tok)
            if tok == stop_id:
                break
        return new


def encode_prompt(tok, prompt: str) -> list[int]:
    """EOS, then the prompt's tokens without BOS: how every document but the first starts in the training data."""
    return [tok.eos_token_id] + list(tok(prompt, add_special_tokens=False)["input_ids"])


def sample_texts(sampler: Sampler, tok, prompts: list[str], max_new_tokens: int, temperature: float, top_k: int,
                 seed: int) -> list[dict]:
    """One continuation per prompt (seed + i for the i-th), decoded."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tok, prompt)
        new = sampler.generate_ids(ids, max_new_tokens, temperature, top_k, seed + i)
        out.append(dict(prompt=prompt, text=tok.decode(new, skip_special_tokens=False), tokens=new))
    return out


# ------------------------------------------------------------------------------------ checkpoints


def resolve_checkpoint(path) -> Path:
    """A training checkpoint folder from a run folder (its newest checkpoint) or a checkpoint folder itself."""
    p = Path(path)
    if (p / "state.json").is_file() and (p / "state.ckpt").is_file():
        return p
    found = checkpoint.latest(p)
    if found is None:
        raise LabkitError(f"{path} is neither a run folder with checkpoints/ nor a checkpoint folder",
                          "give the --output of `labkit train` or one of its checkpoints/step_* folders")
    return found


def load_checkpoint(path, tokenizer=None) -> dict:
    """Model config, weights, run config, training length and tokenizer (the run's own, or `tokenizer`) of a
    training checkpoint. The weights are checked against the recorded config and the tokenizer against its
    vocabulary before they are loaded (labkit.training.run_dir.check_trained)."""
    ck = resolve_checkpoint(path)
    meta = json.loads((ck / "state.json").read_text(encoding="utf-8"))
    if "config" not in meta:
        raise LabkitError(f"{ck / 'state.json'} has no run config", "use a checkpoint written by labkit train")
    run = load(RunConfig, meta["config"], f"{ck / 'state.json'}: config")
    tok = lab_path(tokenizer) if tokenizer else run_tokenizer(run)
    run_dir.check_trained(ck, run, tok)
    return dict(checkpoint=ck, step=meta.get("step"), run=run, model_cfg=run.model_config(),
                weights=checkpoint.load_weights(ck), tokenizer=tok)


def generate(checkpoint, prompt: str, max_new_tokens: int = 48, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, window: int | None = None, tokenizer=None) -> dict:
    """Continue `prompt` with the model of a training checkpoint (CPU). `tokenizer` overrides the run's own
    (notebook 02 decodes with the wrong one on purpose)."""
    ck = load_checkpoint(checkpoint, tokenizer)  # the pairs are checked before MindSpore is imported
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    tok_dir = ck["tokenizer"]
    tok = load_fast_tokenizer(tok_dir)
    sampler = Sampler(ck["model_cfg"], window or ck["run"].data.seq_len)
    sampler.load(ck["weights"])
    ids = encode_prompt(tok, prompt)
    new = sampler.generate_ids(ids, max_new_tokens, temperature, top_k, seed)
    return dict(ok=True, checkpoint=str(ck["checkpoint"]), step=ck["step"], prompt=prompt, prompt_ids=ids,
                tokens=new, text=tok.decode(new, skip_special_tokens=False), tokenizer=str(tok_dir),
                temperature=temperature, top_k=top_k, seed=seed, window=sampler.window)


# ------------------------------------------------------------------------------------------- CLI


def add_cli(parser) -> None:
    parser.add_argument("--checkpoint", required=True, help="run folder of `labkit train` or a checkpoints/step_* folder")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate (default 48)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); e.g. 0.8 to sample")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=_cli)


def _cli(args) -> int:
    r = generate(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    emit(args, r, r["prompt"] + r["text"])
    return 0
