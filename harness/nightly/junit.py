"""The night as JUnit XML: one testcase per step."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

from harness.nightly.step import StepResult
from harness.simbox.box import SIMULATED_ENV


def junit_xml(results: Sequence[StepResult], name: str = "nightly-gpu", simulated: str | None = None) -> str:
    """One testcase per step: failure for failed/timed-out steps, skipped with its reason; a passed step's note (a
    simulated box's) in its output. ``simulated``: the box, as a property of the suite."""
    suite = ET.Element(
        "testsuite",
        name=name,
        tests=str(len(results)),
        failures=str(sum(r.status in ("failed", "timeout") for r in results)),
        skipped=str(sum(r.status == "skipped" for r in results)),
        errors="0",
        time=f"{sum(r.seconds for r in results):.1f}",
    )
    if simulated:
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="simulated_gpus", value=f"{SIMULATED_ENV}={simulated}")
    for r in results:
        case = ET.SubElement(
            suite, "testcase", classname=f"nightly.{r.step.kind}", name=r.step.id, time=f"{r.seconds:.1f}"
        )
        if r.status == "skipped":
            ET.SubElement(case, "skipped", message=r.message)
        elif r.status in ("failed", "timeout"):
            ET.SubElement(case, "failure", message=r.message, type=r.status).text = r.message
        out = [r.message] if r.status == "passed" and r.message else []
        if r.log:
            out.append(f"log: {r.log}")
        if out:
            ET.SubElement(case, "system-out").text = "\n".join(out)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)
