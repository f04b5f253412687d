"""Structured outputs: a request's output held to a JSON schema, a regex, a choice of strings or
a Lark grammar, by masking the tokens the grammar forbids before each sampling.

    spec.py        StructuredOutput: what a request asks for (torch-free, llguidance-free: it
                   travels in SamplingParams to the engine); its llguidance grammar text, checked
                   without a tokenizer so the API process can refuse a bad one with a 400
    vocabulary.py  the model's vocabulary as llguidance sees it: every id's bytes, the special
                   ids (never text), the EOS ids; built once from moeserve's Tokenizer
    grammars.py    the engine's side: one matcher per request, the step's token bitmask for the
                   rows that sample under a grammar, each sampled token accepted, a request's
                   grammar ending or refusing its token reported

The engine (engine/core.py) builds the bitmask after scheduling and hands it to the runner in the
SchedulerOutput; the sampler (layers/sampler.py, `mask_tokens_`) sets the forbidden logits to -inf.
Overlap scheduling: a step with a grammar row needs the previous step's tokens before its mask
exists, so the engine enqueues its forward, settles the step in flight while it runs, then
samples it under the masks (engine/structured_steps.py); decode steps under a grammar run one
token at a time.
"""
