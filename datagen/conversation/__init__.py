"""The conversation as the unit of generation: a run's turn mode, and what a shard's checkpoint holds of each one.

A prompt is a conversation of one or more steps (generations). `turn_mode.TurnMode`, chosen once from the run
spec, says which steps are generated and how: `last` (the recorded conversation is the history, its last reply
is generated: one step) or `every` (each assistant turn is generated in order, conditioned on the model's own
earlier ones). `ledger.read_ledger` reads a shard's checkpoint as conversations under either mode. The shard
driver (tasks/generation.py) runs both through one loop.
"""
