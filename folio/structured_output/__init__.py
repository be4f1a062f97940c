"""Structured output: constrain a request's tokens with a grammar (JSON schema, regex, choice, Lark/GBNF grammar).

`params` is the request-side description (plain data, part of SamplingParams); `backend` the interface a grammar
library implements (`llguidance_backend` today); `manager` compiles grammars off the step loop and builds each
step's token bitmask in the engine core; `token_mask` applies that bitmask in the model runner's sampler.
"""
