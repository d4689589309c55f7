"""Session layer: the public `Runtime`, chat rendering and parsing, tokenizers (later: turn
orchestration, the agent loop). Imports the engine; never imported by it.
"""
