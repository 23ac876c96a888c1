"""How the ranks share the model: a Strategy (DDP or FSDP) that the loop calls and
never branches on."""
