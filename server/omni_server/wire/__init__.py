"""The wire room: what crosses between the server process and the stage processes (messages,
their codec, the channels over rings and ZMQ, the CUDA lane, `Links`, heartbeats, and the
plan's routes). Both sides import it; it imports neither side."""
