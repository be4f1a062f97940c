"""Speculative decoding: cheap guesses of the next tokens (drafts), verified by the target model in one forward
pass and kept only where the rejection sampler accepts them, so greedy outputs are exactly those without
speculation and sampled ones follow the same distribution.

Proposers (ngram, suffix, draft_model) live beside the model runner, which calls them after each step's
sampling; the drafts travel back to the scheduler in the ModelRunnerOutput and are scheduled with the next
step's tokens (folio.core.step_contract). The policy (folio.spec_decode.speculator) decides how many drafts each
request gets, so speculation that does not pay backs off on its own.
"""
