"""shardtune's GRPO / DAPO / Dr. GRPO loss and gradient against TRL's GRPOTrainer `_compute_loss` on the
same prompt, completions, advantages and (β > 0) reference log-probs: SmolLM2 cut to 2 layers, fp32.

    python -m venv --system-site-packages /tmp/trlvenv && /tmp/trlvenv/bin/pip install trl
    PYTHONPATH=$PWD /tmp/trlvenv/bin/python bench/grpo_vs_trl.py

TRL is not a dependency: this runs in a throwaway venv. For each variant it prints the two losses and
the largest |Δ| over every parameter's gradient, relative to the gradient's largest entry; exit 1 when
any is above 1e-5. Ours: train/core/grpo.py's rows and chunked log-probs, rl_loss.py's terms and
normalisation on one rank (global counts = this batch's); TRL's: its own forward (logits / temperature
over the completion positions) and loss, with `use_bias_correction_kl=False` (TRL 1.16 defaults it to True:
the KL × the ratio, DeepSeek-V3.2's gradient; shardtune's KL is the GRPO paper's k3, TRL's before 1.x).
"""
from __future__ import annotations

import sys
import tempfile

import torch

from shardtune.testing.smollm2 import cut_folder
from shardtune.train.core.grpo import rows_of, token_logps
from shardtune.train.core.rl_generate import Group
from shardtune.train.core.rl_loss import reduce_loss, token_terms

G, MAX_NEW, TEMP = 4, 6, 0.9


def trl_trainer(folder, loss_type: str, beta: float, eps_high: float):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=G, num_generations=G,
                      max_completion_length=MAX_NEW, temperature=TEMP, loss_type=loss_type, beta=beta, epsilon=0.2,
                      epsilon_high=eps_high, report_to=[], use_cpu=True, bf16=False, logging_steps=1,
                      use_bias_correction_kl=False)  # the GRPO paper's k3 KL (TRL 1.16's default multiplies it by
    # the ratio, DeepSeek-V3.2's correction: the same value at μ = 1, another gradient; docs/rl.md)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "Write the date 2017-03-09 as DD/MM/YYYY."}]),
                          processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1
    return trainer, tok


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def compare(folder, loss_type: str, beta: float, eps_high: float) -> float:
    trainer, tok = trl_trainer(folder, loss_type, beta, eps_high)
    model = trainer.model.train()
    gen = torch.Generator().manual_seed(0)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write the date 2017-03-09 as DD/MM/YYYY."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    lengths = [6, 3, 5, 1]
    tokens = torch.randint(100, 20000, (G, MAX_NEW), generator=gen)
    mask = torch.tensor([[t < n for t in range(MAX_NEW)] for n in lengths])
    tokens = torch.where(mask, tokens, tok.pad_token_id)
    adv = torch.tensor([1.2, -0.4, -1.1, 0.3])
    ref = None
    if beta:  # the reference: the policy's log-probs moved by ±0.5 a token, as a frozen copy's might be (a
        # reference within fp32 noise of the policy would make the KL's gradient, 1 − exp(ref − logp), all noise)
        with torch.no_grad():
            ref = token_logps(model, *_ours_rows(prompt, tokens, mask, tok)[:2], 1, TEMP)
            ref = ref + torch.empty_like(ref).uniform_(-0.5, 0.5, generator=gen)
    inputs = {"prompt_ids": torch.tensor([prompt] * G), "prompt_mask": torch.ones(G, len(prompt), dtype=torch.long),
              "completion_ids": tokens, "completion_mask": mask.long(), "advantages": adv,
              "num_items_in_batch": mask.sum().float()}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref[:, len(prompt) - 1:len(prompt) - 1 + MAX_NEW]
    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    g_theirs = grads(model)
    ids, labels = _ours_rows(prompt, tokens, mask, tok)[:2]
    logps = token_logps(model, ids, labels, 4, TEMP)
    terms = token_terms(logps, logps.detach(), adv, 0.2, eps_high, beta, ref)
    ours = reduce_loss(terms.loss, labels != -100, loss_type, num_completions=torch.tensor(float(G)),
                       num_tokens=mask.sum().float(), max_new_tokens=MAX_NEW)
    ours.backward()
    g_ours = grads(model)
    scale = max(float(g.abs().max()) for g in g_theirs)
    worst = max(float((a - b).abs().max()) for a, b in zip(g_ours, g_theirs)) / scale
    print(f"{loss_type:8s} beta {beta:<5g} eps_high {eps_high:<5g} loss ours {float(ours):+.8f} TRL "
          f"{float(theirs):+.8f}  max |dgrad| / max |grad| {worst:.2e}", flush=True)
    return max(abs(float(ours) - float(theirs)), worst)


def _ours_rows(prompt, tokens, mask, tok):
    batch = rows_of([prompt], [Group(tokens=tokens, mask=mask, entropy_sum=torch.zeros(G))], tok.pad_token_id, "cpu")
    return batch["input_ids"], batch["labels"]


def main() -> int:
    folder = cut_folder(2)
    worst = max(compare(folder, lt, beta, eh) for lt in ("grpo", "dapo", "dr_grpo")
                for beta, eh in ((0.0, 0.2), (0.04, 0.28)))
    print(f"worst {worst:.2e} ({'within' if worst <= 1e-5 else 'ABOVE'} 1e-5)")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
