"""`shardtune generate TARGET --prompt TEXT`: what a trained model answers, in one process
(train/generation.py: resolving TARGET, loading it, the answer). Imports no torch at module level
(the CLI answers `shardtune plan` without it)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate(
        target: str = typer.Argument(..., metavar="TARGET", help="An exported HF folder, a run folder (its "
                                     "hf_export, else its newest checkpoint) or a checkpoints/step_<N> folder"),
        prompt: str = typer.Option(..., "--prompt", metavar="TEXT", help="The user's message."),
        max_new_tokens: int = typer.Option(256, "--max-new-tokens", metavar="N", help="Most tokens to generate."),
        temperature: float = typer.Option(0.0, "--temperature", metavar="T",
                                          help="0: greedy (the default); > 0: sample at this temperature."),
        top_p: float = typer.Option(1.0, "--top-p", metavar="P", help="Sampling: keep the most likely tokens "
                                    "up to this probability mass (1: all)."),
        system: str | None = typer.Option(None, "--system", metavar="TEXT", help="A system message before "
                                          "the prompt."),
        seed: int = typer.Option(0, "--seed", metavar="N", help="Sampling seed."),
        trust_unverified: bool = typer.Option(False, "--trust-unverified", help="Load an export's weights "
                                              "even when their SHA-256 cannot be checked or differs."),
    ) -> int:
        """Print what a trained model answers to a prompt (chat template applied)."""
        from shardtune.train.generation import generate_answer  # lazy: torch-free CLI start-up

        print(generate_answer(target, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, system=system, seed=seed, trust_unverified=trust_unverified))
        return 0
