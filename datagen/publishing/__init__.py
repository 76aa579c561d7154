"""What a run leaves in S3: the one interface to it, the catalog of prompt ids, the card, pinned facts."""
