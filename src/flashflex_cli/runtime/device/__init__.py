"""The device a rank runs on: synchronisation, timestamps inside a step, and the emulated slowdown of CPU devices."""
