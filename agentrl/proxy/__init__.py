"""The recording proxy: OpenAI- and Anthropic-compatible HTTP faces in front of the engines whose sessions are
recorded token-in/token-out and closed into trajectories, so an agent written against an SDK is trained
unchanged (docs/agents.md).

- `session.py` (`ProxySessions`): sessions of chat turns recorded as token segments; `segments.py` decides
  which segment a request continues and which are side requests; `tools.py` and `tool_parsers.py` turn a
  request's tools into the prompt and a reply into tool calls; `openai_params.py` owns which sampling
  parameters are honoured.
- The faces, each a request shape translated into the one chat request (`openai_schema.py`) and a reply
  shape: OpenAI chat (`server.py`, `openai_response.py`), the Responses API (`openai_responses.py`,
  `responses_schema.py`) and Anthropic Messages (`anthropic_messages.py`, `anthropic_schema.py`,
  `anthropic_response.py`); `openapi.py` describes them all; `token_bytes.py` gives logprobs their bytes.
- `server.py` (`OpenAIProxy`) serves the sessions over HTTP; `cli.py` is `agentrl serve-proxy`;
  `endpoints.py` writes the URLs of a run's servers to `runs/NAME/proxy.json`.

The generators that run agents against it (`openai_proxy`, `external`, the verifiers generator) live in
`agentrl.generators`, one layer up.
"""
