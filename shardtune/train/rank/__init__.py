"""The trainer's rank side: what every process under torchrun runs: main (the entry), context
(who this rank is), loop (set-up → loop → finish)."""
