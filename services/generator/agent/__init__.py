"""Episodes: the responses the generator samples as multi-turn conversations rather than one turn.

The sampling loop (``services/generator/loop.py``) calls into this package at two points only.
At start, one of

- ``tool_loop.start_runner`` (``generator.max_turns > 1``): Tether's built-in tool loop;
- ``runner.start_agents`` (``[agent]``): your agent code, through the OpenAI-compatible endpoint;

and then, on the object it got back, ``run_prompt`` for each prompt (its responses as
``wire.Trajectory``, one per episode segment) and ``close`` when the loop stops.

The modules, from the loop down:

- ``tool_loop``: the built-in tool loop. Samples an assistant turn, runs its tool calls in the
  sandbox, appends the answers by template difference, until the model stops or a limit cuts it
  (``EpisodeRunner``, ``EpisodeSettings``, ``EpisodeMetrics``; ``versions_of``).
- ``runner``: your agent's episodes for a prompt: ``responses_per_prompt`` runs of the agent code,
  each with a client scoped to its episode, turned into the prompt's trajectories with the
  agent's reward, answer or error (``AgentRunner``, ``start_agents``).
- ``code``: the agent code as the generator runs it: loaded from ``agent.run``/``agent.gym_env``,
  run on an event loop of its own with a watchdog, its return value turned into a reward
  (``load_agent``, ``AgentLoop``, ``reward_of``).
- ``gym``: the agent that drives a gym-style environment (``agent.gym_env``) through the
  endpoint (``GymAgent``).
- ``endpoint``: the OpenAI-compatible HTTP endpoint on 127.0.0.1 (aiohttp): token, size limit,
  routing to an open episode; each request handed to ``turns`` (``AgentEndpoint``).
- ``turns``: one request answered: checked, its prompt found, sampled by vLLM, recorded, and
  answered in OpenAI's shape with the model's tool calls parsed (``AgentTurns``, ``TurnLimits``).
- ``openai_api``: OpenAI's request and response shapes, every body checked as untrusted
  (``ApiError``, ``Sampling``).
- ``episodes``: an agent's episodes as its requests arrive: the table of open episodes, their
  segments, and the rules by which a request extends the transcript or starts a new segment
  (``EpisodeTable``, ``AgentEpisode``, ``ContinuityRules``).
- ``recorder``: the record of one episode, token in, token out, that becomes its trajectory; both
  the tool loop and the agent's turns feed one (``EpisodeRecorder``).
"""
