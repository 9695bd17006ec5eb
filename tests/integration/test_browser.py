"""The explorers in a real browser: the sharding explorer in JupyterLab on loopback, and the site's static explorer
page from a file, each in headless Chromium with a control moved.

1. Write a two-cell notebook that displays `sharding_explorer()` into a temporary folder.
2. Start JupyterLab there: loopback, a free port, a random token, no browser of its own, its settings in the
   temporary folder too.
3. Open the notebook in headless Chromium (Debian's `chromium` and `chromium-driver`, driven by selenium; nothing
   is downloaded), run all cells, read the explorer's summary, move the "layout" control, and wait for the summary
   to change. A screenshot goes to build/test-artifacts/.
4. The static page (`playbook.explorer.write_page` on a small grid, no notebooks, no kernel): read a displayed
   value, move a select and the concurrency slider, and check the values shown are the library's for the new
   settings.

Without a browser the test is skipped, saying how to get one; under CI=true it fails instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "build" / "test-artifacts"
EXPLORER = "from qwen35_lib.viz.sharding_explorer import sharding_explorer"
SUMMARY = ".qwen35-explorer-summary"
HOW_TO_GET_ONE = ("apt-get install chromium chromium-driver (Debian; .ci/run does this), and pip install selenium "
                  "jupyterlab (the 'test' and 'notebook' extras)")


def _tools(jupyterlab: bool = True) -> tuple[str, str]:
    """Paths of chromium and chromedriver; skip (fail under CI=true) when something is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    missing = [name for name, ok in (("chromium", chromium), ("chromedriver", driver),
                                     ("selenium", importlib.util.find_spec("selenium")),
                                     ("jupyterlab", importlib.util.find_spec("jupyterlab") or not jupyterlab))
               if not ok]
    if missing:
        message = f"no {', '.join(missing)}: {HOW_TO_GET_ONE}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return chromium, driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_notebook(folder: pathlib.Path) -> str:
    setup = ("from qwen35_lib.devices import simulate_cpu_devices\n"
             "simulate_cpu_devices(8)  # the playbook's 8 simulated devices")
    cells = [nbformat.v4.new_code_cell(setup), nbformat.v4.new_code_cell(f"{EXPLORER}\n\nsharding_explorer()")]
    nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "language": "python",
                                                                         "display_name": "Python 3"}})
    nbformat.write(nb, folder / "explorer.ipynb")
    return "explorer.ipynb"


@contextlib.contextmanager
def jupyterlab(folder: pathlib.Path, log: pathlib.Path):
    """A JupyterLab server on 127.0.0.1 serving `folder`; yields its base URL and token."""
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JUPYTER_CONFIG_DIR=str(folder / ".jupyter"),
               JUPYTER_RUNTIME_DIR=str(folder / ".jupyter/runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(folder / ".jupyter/lab/settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(folder / ".jupyter/lab/workspaces"),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}",
               "--allow-root", "--LabApp.expose_app_in_browser=True"]  # window.jupyterapp: run cells as the menu does
    settings = folder / ".jupyter/lab/settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings"
    settings.parent.mkdir(parents=True)
    settings.write_text('{"fetchNews": "false", "checkForUpdates": false}')  # no news pop-up, no request out
    with log.open("w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=folder)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, f"JupyterLab exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"JupyterLab did not start in 60 s:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            time.sleep(0.5)
        yield url, token
    finally:
        with contextlib.suppress(OSError):  # stops the kernels too
            request = urllib.request.Request(f"{url}/api/shutdown", method="POST",
                                             headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(request, timeout=10)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _chromium(chromium: str, driver: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1100"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def _control(browser, description: str):
    """The ipywidgets control whose label reads `description`."""
    from selenium.webdriver.common.by import By

    xpath = (f"//div[contains(@class, 'widget-inline-hbox') or contains(@class, 'widget-hbox')]"
             f"[./label[normalize-space()='{description}']]")
    return browser.find_element(By.XPATH, xpath)


def _move(control, prefer: str = "") -> None:
    """Change a control's value as a person would: another option (`prefer` if offered), another button, a step."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    if selects := control.find_elements(By.TAG_NAME, "select"):
        select = Select(selects[0])
        current = select.first_selected_option.text
        others = [o.text for o in select.options if o.text != current]
        select.select_by_visible_text(prefer if prefer in others else others[0])
    elif buttons := control.find_elements(By.CSS_SELECTOR, "button:not(.mod-active)"):
        buttons[0].click()
    elif handles := control.find_elements(By.CSS_SELECTOR, ".noUi-handle"):
        handles[0].send_keys(Keys.ARROW_LEFT if handles[0].get_attribute("aria-valuenow") ==
                             handles[0].get_attribute("aria-valuemax") else Keys.ARROW_RIGHT)
    else:
        field = control.find_element(By.TAG_NAME, "input")
        field.send_keys(Keys.ARROW_UP, Keys.ENTER)


def _summary(browser) -> str:
    """The explorer's summary text ("" until it shows); the element is replaced whenever the summary changes."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return "\n".join(e.text for e in browser.find_elements(By.CSS_SELECTOR, SUMMARY)).strip()
    except StaleElementReferenceException:
        return ""


KERNEL_IDLE = """
const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
const kernel = panel && panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
return !!kernel && kernel.status === 'idle';
"""


def test_sharding_explorer_in_jupyterlab(tmp_path: pathlib.Path):
    from selenium.webdriver.support.ui import WebDriverWait

    chromium, driver = _tools()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    work = tmp_path / "work"  # the notebook's temporary working copy; the server's root
    work.mkdir()
    name = _write_notebook(work)
    log = tmp_path / "jupyterlab.log"
    with jupyterlab(work, log) as (url, token):
        browser = _chromium(chromium, driver)
        try:
            browser.get(f"{url}/lab/tree/{name}?token={token}")
            WebDriverWait(browser, 90, 0.5).until(lambda b: b.execute_script(KERNEL_IDLE))
            browser.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            before = WebDriverWait(browser, 90, 0.5).until(_summary)
            _move(_control(browser, "layout"), prefer="tp8_kvrep")  # naive TP: KV heads copied 4x
            after = WebDriverWait(browser, 30, 0.3).until(lambda b: _summary(b) not in ("", before) and _summary(b))
            WebDriverWait(browser, 30, 0.3).until(lambda b: b.execute_script(KERNEL_IDLE))  # the figure redrawn
            browser.save_screenshot(str(ARTIFACTS / "sharding_explorer.png"))
            assert after and after != before
        except Exception:
            browser.save_screenshot(str(ARTIFACTS / "sharding_explorer_failed.png"))
            print(f"JupyterLab log (tail):\n{log.read_text()[-3000:]}")
            raise
        finally:
            browser.quit()


def test_static_explorer_page_without_a_kernel(tmp_path: pathlib.Path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from playbook import explorer
    from qwen35_lib.config import get_config
    from qwen35_lib.costmodel import predict
    from qwen35_lib.placement import placement

    chromium, driver = _tools(jupyterlab=False)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    grid = dict(hardware=("tpu7x-8",), layouts=("tp_kvrep", "dp_ep"), contexts=(8192, 32768), requests=(512,))
    page = explorer.write_page(tmp_path, grid, dict(workloads=((1024, 1024),), concurrencies=(16, 32)))
    cfg = get_config(explorer.MODEL, expert_dtype="float8_e4m3fn", gdn_state_dtype="bfloat16")  # the page's defaults
    kv = {n: placement(cfg, "dp_ep", 8, "float8_e4m3fn", 512, context_len=n).kv_bytes_per_device for n in (8192, 32768)}
    kernels = predict(explorer.MODEL, "tpu7x-8", "kernels", 1024, 1024, 16, roofline=False)["total_tokens_per_s"]

    def shown(b, css: str, attr: str) -> str:
        return b.find_element(By.CSS_SELECTOR, css).get_attribute(attr)

    browser = _chromium(chromium, driver)
    try:
        browser.get(page.as_uri())
        kv_css = f"{SUMMARY} [data-field=kv]"
        assert int(WebDriverWait(browser, 20, 0.2).until(lambda b: shown(b, kv_css, "data-bytes"))) == kv[8192]
        Select(browser.find_element(By.ID, "ctl-context")).select_by_value("32768")
        after = WebDriverWait(browser, 20, 0.2).until(lambda b: shown(b, kv_css, "data-bytes") != str(kv[8192])
                                                       and shown(b, kv_css, "data-bytes"))
        assert int(after) == kv[32768] and browser.find_element(By.CSS_SELECTOR, kv_css).text == \
            f"{kv[32768] / 2**30:,.2f} GiB"
        bar = "#ladder-bars [data-stage=kernels] [data-field=total_tokens_per_s]"
        before = shown(browser, bar, "data-value")
        browser.find_element(By.ID, "ctl-concurrency").send_keys(Keys.ARROW_LEFT)  # 32 -> 16 requests
        value = WebDriverWait(browser, 20, 0.2).until(lambda b: shown(b, bar, "data-value") != before
                                                       and shown(b, bar, "data-value"))
        assert float(value) == kernels and browser.find_element(By.ID, "concurrency-value").text == "16 requests"
        assert float(shown(browser, "#two-by-two-table [data-stage=kernels]", "data-value")) == kernels  # the 2 x 2
        browser.save_screenshot(str(ARTIFACTS / "static_explorer.png"))
    except Exception:
        browser.save_screenshot(str(ARTIFACTS / "static_explorer_failed.png"))
        raise
    finally:
        browser.quit()
