"""Sources: the only code that reads hardware or OS state (NVML, sysfs, /dev/kmsg, udev, DCGM, external tools,
processes, sd_notify). Each has a live and a recorded form.

It may import the core only; the hardware libraries (pynvml, pyudev, torch) are imported here and nowhere else.
"""
