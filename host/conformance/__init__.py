"""The WIT conformance suite's runner: cases under conformance/cases/, performed by the probe
component (conformance/components/probe) on a host reached through a HostAdapter."""
