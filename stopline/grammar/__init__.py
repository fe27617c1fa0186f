"""Structured output: grammars that constrain what a request may sample.

One concept a file:
  vocab.py        stopline's tokenizer as llguidance sees it (token bytes, EOS, mask width)
  formats.py      OpenAI `response_format` (and stopline's extensions) -> a grammar
  tool_format.py  the text a model writes for a tool call, and its parser
  tools.py        `tools` / `tool_choice` / `parallel_tool_calls` -> a grammar
  compiler.py     the compile service: off the step thread, shared, deadlined, cancellable
  matcher.py      one request's grammar state: consume, mask, accept, rollback
  bitmask.py      a packed mask applied to a row of logits

Layering: this package imports tokenizer/, request, config and errors only; the engine,
worker and server import it.
"""
