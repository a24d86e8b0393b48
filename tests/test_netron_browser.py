"""Netron in a real browser: the module hierarchy is visible and can be entered.

A tiny GPT-2 is exported, served with the ``netron`` package on localhost, and opened
in headless Chromium driven by ``chromedriver`` through selenium. The test checks
that the main graph shows the module-call nodes (``h.0``, ``h.1`` as ``GPT2Block``),
enters ``h.0``'s function ("Show Function Definition") and finds the nested calls
(``attn``, ``mlp``, ...: named relative to the shared body), then reads the call-node metadata and the function
doc string in Netron's sidebars.

Screenshots go to ``$ONNX_MODULAR_SCREENSHOT_DIR`` (or a temporary folder):
``netron_top.png``, ``netron_block.png``, ``netron_call_metadata.png``,
``netron_function_doc.png``.

Skipped when Chromium, chromedriver, selenium or netron is missing. Every wait is
bounded; the server and the browser are stopped in teardown.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import time

import pytest

selenium = pytest.importorskip("selenium")
netron = pytest.importorskip("netron")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import TimeoutException, WebDriverException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


def _executable(name: str, default: str) -> str | None:
    for candidate in (shutil.which(name), default):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


CHROMIUM = _executable("chromium", "/usr/bin/chromium")
CHROMEDRIVER = _executable("chromedriver", "/usr/bin/chromedriver")
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("needs Chromium and chromedriver (apt-get install chromium chromium-driver)", allow_module_level=True)

WAIT_SECONDS = 60
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1600,1000",
    # Netron is served locally; nothing else may be reached (its consent check and analytics).
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost",
]

# Runs before Netron's own scripts: record cookie consent (otherwise Netron shows a consent
# screen), and make the page's build date today (Netron refuses to open models with an
# "update to the newest version" screen when its build is more than 180 days old).
BEFORE_PAGE_SCRIPT = """
document.cookie = 'consent=' + Date.now() + ';path=/';
document.addEventListener('DOMContentLoaded', () => {
  const today = new Date().toISOString().slice(0, 19).replace('T', ' ');
  for (const meta of document.querySelectorAll('meta[name=date]')) { meta.content = today; }
});
"""

# The label of a node (its type, e.g. GPT2Block) and whether it has the "ƒ" definition button.
NODE_INFO_SCRIPT = """
const node = document.getElementById('node-name-' + arguments[0]);
if (!node) { return null; }
const items = Array.from(node.querySelectorAll('.node-item-type'));
return {
  type: items.length ? items[0].querySelector('text').textContent : null,
  tooltip: items.length && items[0].querySelector('title') ? items[0].querySelector('title').textContent : null,
  definition: items.some(item => item.querySelector('title') && item.querySelector('title').textContent === 'Show Function Definition'),
};
"""


@pytest.fixture(scope="module")
def screenshot_dir(tmp_path_factory) -> pathlib.Path:
    configured = os.environ.get("ONNX_MODULAR_SCREENSHOT_DIR")
    if configured:
        folder = pathlib.Path(configured)
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def gpt2_file(tmp_path_factory) -> pathlib.Path:
    from onnx_modular import export_modular
    from onnx_modular.hf import demo

    model, args = demo.gpt2()
    path = tmp_path_factory.mktemp("netron") / "gpt2.onnx"
    export_modular(model, args, path, verify=False)
    return path


@pytest.fixture(scope="module")
def shown_file(gpt2_file, tmp_path_factory) -> pathlib.Path:
    """What ``onnx-modular view`` serves: the file with its lifted constants back in their bodies."""
    from onnx_modular.storage.display import write_display_copy

    copy = tmp_path_factory.mktemp("view") / gpt2_file.name
    assert write_display_copy(gpt2_file, copy)
    return copy


@contextlib.contextmanager
def served(path: pathlib.Path):
    address = netron.start(str(path), address=("localhost", 0), browse=False)
    try:
        host, port = address
        yield f"http://{host}:{port}/"
    finally:
        netron.stop(address)


@pytest.fixture(scope="module")
def netron_url(shown_file):
    with served(shown_file) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    # An explicit driver path: selenium must not try to download one.
    service = Service(executable_path=CHROMEDRIVER)
    try:
        driver = webdriver.Chrome(service=service, options=options)
    except WebDriverException as e:
        pytest.skip(f"Chromium could not be started: {e.msg}")
    try:
        driver.set_page_load_timeout(WAIT_SECONDS)
        driver.set_script_timeout(WAIT_SECONDS)
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": BEFORE_PAGE_SCRIPT})
        yield driver
    finally:
        driver.quit()


def wait_for(driver, script: str, *args, what: str):
    """Poll ``script`` until it returns something truthy; fail after WAIT_SECONDS."""
    try:
        return WebDriverWait(driver, WAIT_SECONDS, poll_frequency=0.2).until(lambda d: d.execute_script(script, *args))
    except TimeoutException:
        body = driver.execute_script("return document.body ? document.body.className : ''")
        pytest.fail(f"Timed out after {WAIT_SECONDS}s waiting for {what} (page state: {body!r})")


def click(driver, element) -> None:
    """A real click; falls back to a DOM click event when something overlays the element."""
    try:
        element.click()
    except WebDriverException:
        driver.execute_script("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", element)


def open_model(driver, url: str) -> None:
    driver.get(url)
    wait_for(driver, "return document.getElementById('node-name-h.0')", what="the main graph of the model")
    time.sleep(0.5)  # let the layout's fade-in settle before screenshots


def node_info(driver, name: str) -> dict | None:
    return driver.execute_script(NODE_INFO_SCRIPT, name)


def center_on(driver, name: str) -> None:
    driver.execute_script(
        "document.getElementById('node-name-' + arguments[0]).scrollIntoView({block: 'center', inline: 'center'})", name
    )
    time.sleep(0.3)


def enter_function(driver, name: str) -> None:
    """Click the "ƒ" (Show Function Definition) button of call node ``name``."""
    center_on(driver, name)
    button = driver.execute_script(
        "return Array.from(document.getElementById('node-name-' + arguments[0]).querySelectorAll('.node-item-type'))"
        ".find(item => item.querySelector('title') && item.querySelector('title').textContent === 'Show Function Definition')",
        name,
    )
    assert button is not None, f"{name} has no 'Show Function Definition' button"
    click(driver, button)


def breadcrumb(driver, last: str) -> list[str]:
    """The names in Netron's path bar, once ``last`` is shown there (it updates asynchronously)."""
    return wait_for(
        driver,
        "const names = Array.from(document.querySelectorAll('.toolbar-path-name-button')).map(e => e.textContent);"
        "return names.length && names[names.length - 1] === arguments[0] ? names : null",
        last,
        what=f"{last} in the path bar",
    )


def graph_text(driver) -> str:
    return driver.execute_script("return document.getElementById('canvas').textContent")


def input_names(driver) -> list[str]:
    """The graph-input boxes Netron draws for the graph or function body on screen."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('[id^=\"input-name-\"]')).map(e => e.id.slice('input-name-'.length))"
    )


def test_top_level_shows_the_module_calls(browser, netron_url, screenshot_dir):
    open_model(browser, netron_url)
    # Call nodes are named after module paths; Netron labels them with the function name.
    for name, function in [("wte", "Embedding"), ("h.0", "GPT2Block"), ("h.1", "GPT2Block"), ("ln_f", "LayerNorm")]:
        info = node_info(browser, name)
        assert info is not None, f"call node {name} is not in the main graph"
        assert info["type"] == function and info["tooltip"] == name
        assert info["definition"], f"{name} cannot be entered"
    # The nested calls are not in the main graph: they live in the function bodies.
    assert node_info(browser, "attn") is None
    # The block call lists its input and its weights, not the constants lifted for onnxruntime.
    assert "const_" not in graph_text(browser)
    for _ in range(2):
        click(browser, browser.find_element(By.ID, "zoom-out-button"))
    center_on(browser, "h.0")
    assert browser.save_screenshot(str(screenshot_dir / "netron_top.png"))


def test_entering_a_block_shows_its_nested_calls(browser, netron_url, screenshot_dir):
    open_model(browser, netron_url)
    enter_function(browser, "h.0")
    wait_for(browser, "return document.getElementById('node-name-attn')", what="the body of GPT2Block")
    time.sleep(0.5)
    assert breadcrumb(browser, "GPT2Block")[-1] == "GPT2Block"
    # Inside the shared body, call nodes are named relative to it (the block's own path is
    # h.0 or h.1 depending on the caller); the full path is in the metadata.
    expected = [
        ("ln_1", "LayerNorm"),
        ("attn", "GPT2Attention"),
        ("ln_2", "LayerNorm"),
        ("mlp", "GPT2MLP"),
    ]
    for name, function in expected:
        info = node_info(browser, name)
        assert info is not None and info["type"] == function, (name, info)
        assert info["definition"]
    # Its inputs: hidden_states, the folded mask and the twelve weights; no lifted constant.
    inputs = input_names(browser)
    assert "hidden_states" in inputs and "ln_1.weight" in inputs and len(inputs) == 14, inputs
    assert not any(name.startswith("const_") for name in inputs)
    assert browser.save_screenshot(str(screenshot_dir / "netron_block.png"))

    # The call node's metadata: module path, class, package and version, source.
    label = browser.execute_script(
        "return document.getElementById('node-name-attn').querySelector('.node-item-type')"
    )
    click(browser, label)
    sidebar = wait_for(
        browser,
        "const s = document.getElementById('sidebar'); return s && s.innerText.includes('METADATA') ? s.innerText : null",
        what="the node properties sidebar",
    )
    assert "transformers.models.gpt2.modeling_gpt2.GPT2Attention" in sidebar
    import transformers

    assert "h.0.attn" in sidebar and transformers.__version__ in sidebar and "modeling_gpt2.py:" in sidebar
    time.sleep(0.6)  # the sidebar slides in
    assert browser.save_screenshot(str(screenshot_dir / "netron_call_metadata.png"))

    # The function's doc string names its class and every module path that calls it.
    click(browser, browser.find_element(By.ID, "sidebar-target-button"))
    sidebar = wait_for(
        browser,
        "const s = document.getElementById('sidebar'); return s && s.innerText.includes('2 calls: h.0, h.1') ? s.innerText : null",
        what="the function properties sidebar",
    )
    assert "GPT2Block: transformers.models.gpt2.modeling_gpt2.GPT2Block" in sidebar
    time.sleep(0.6)
    assert browser.save_screenshot(str(screenshot_dir / "netron_function_doc.png"))

    # Nested functions work too: enter GPT2Attention from inside GPT2Block.
    click(browser, browser.find_element(By.ID, "sidebar-closebutton"))
    enter_function(browser, "attn")
    wait_for(browser, "return document.getElementById('node-name-c_attn')", what="the body of GPT2Attention")
    assert breadcrumb(browser, "GPT2Attention")[-2:] == ["GPT2Block", "GPT2Attention"]
    assert node_info(browser, "c_proj")["type"] == "Conv1D_2"


def test_the_file_as_stored_shows_the_lifted_constants_as_block_inputs(browser, gpt2_file, screenshot_dir):
    """``onnx-modular view --as-stored``: what Netron shows when it opens the file itself."""
    with served(gpt2_file) as url:
        open_model(browser, url)
        assert "const_int64" in graph_text(browser)  # rows of the block call boxes
        enter_function(browser, "h.0")
        wait_for(browser, "return document.getElementById('node-name-attn')", what="the body of GPT2Block")
        time.sleep(0.5)
        inputs = input_names(browser)
        lifted = [name for name in inputs if name.startswith("const_")]
        assert len(lifted) >= 10 and len(inputs) == 14 + len(lifted), inputs
        assert browser.save_screenshot(str(screenshot_dir / "netron_block_as_stored.png"))
