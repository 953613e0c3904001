"""The GPU room: the machine's GPUs (`devices`), the MPS control daemon (`mps`) and CUDA IPC
weight sharing across replicas (`weights`). Imports neither the pipeline nor the stage room."""
