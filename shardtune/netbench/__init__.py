"""Network measurement: `shardtune bench comm` (nccl-tests style algbw / busbw) and its profile."""
