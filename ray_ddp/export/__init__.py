"""`ray-ddp export`: a run's checkpoint as a model file or a Hugging Face folder. It reads
the checkpoint (checkpoint/) and builds the model it came from (models/), so it stands
above both."""
