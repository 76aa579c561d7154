"""The unit of work: a conversation's script, its generated steps, segments, export and counts."""
