"""The benchmark layer: `agentrt bench ...`. Each module loads a model once, runs every
requested configuration in one invocation and returns a JSON-ready report (machine, settings,
figures, ratios against the baselines of the same run). Imports flow from here into the
runtime, never back."""
