"""Takes the README's screenshots of the chat page and the live iteration view, with the real default
model (SmolLM2-135M-Instruct) behind the real server and the test suite's headless Chromium.

    .venv/bin/python tests/e2e/webui_screenshots.py docs/images

Not a test (pytest collects test_*.py only): the pictures are for people, and a model's replies are not
for asserting on. Takes about a minute on a laptop CPU.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from browser import ServedApp, chromium, missing_browser  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from waiting import wait_for  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from server.app import create_app  # noqa: E402
from server.config import ServerConfig  # noqa: E402

QUESTION = (
    "Write a Python function that checks whether a word is a palindrome, then explain it in two sentences."
)
FOLLOW_UP = "Now make it ignore case and spaces."

# Requests that keep the batch busy for the live view: (seconds after the first, prompt, max_tokens).
LONG = "Summarise this: " + "The quick brown fox jumps over the lazy dog. " * 20  # prompt chunks
BACKGROUND = [
    (0.0, "Tell me about the sea.", 90),
    (0.8, "List five fruits.", 30),
    (1.6, LONG, 40),
    (2.6, "What is the capital of France?", 12),
    (3.4, "Write a haiku about autumn.", 40),
    (4.4, "Explain continuous batching in one paragraph.", 80),
    (5.4, "Count from one to ten.", 25),
    (6.2, LONG, 30),
    (7.0, "Name three planets.", 20),
    (8.0, "Why is the sky blue?", 60),
    (9.0, "Give me a short motto.", 15),
    (10.0, "Describe a cat in one sentence.", 40),
]
SNAPSHOT_AFTER_S = 13.0


def set_dark(driver, dark: bool) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]},
    )


def send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys("\n")


def replies_done(driver, n: int) -> bool:
    return len(driver.find_elements(By.CSS_SELECTOR, "article.msg.assistant .stats")) >= n


def chat(url: str, prompt: str, max_tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout_s=120) as r:
        for _ in r.iter_lines():
            pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder for webui-chat.png, webui-chat-dark.png, webui-live.png")
    args = p.parse_args()
    if missing_browser():
        print(missing_browser(), file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    config = ServerConfig(
        engine=EngineConfig(model="default"),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        log_stats_interval_s=0,
    )
    with ServedApp(create_app(config)) as served, chromium(1280, 940) as driver:
        driver.get(served.url + "/")
        wait_for(lambda: driver.find_element(By.ID, "model-name").text == "default", timeout_s=120)
        driver.execute_script(
            "localStorage.setItem('orca.settings.v1', JSON.stringify({temperature: 0, maxTokens: 160}))"
        )
        driver.refresh()
        wait_for(lambda: driver.find_element(By.ID, "model-name").text == "default")
        send(driver, QUESTION)
        wait_for(lambda: replies_done(driver, 1), timeout_s=120)
        send(driver, FOLLOW_UP)
        wait_for(lambda: replies_done(driver, 2), timeout_s=120)
        # An earlier conversation in the sidebar, as a person's page would have.
        driver.find_element(By.ID, "new-chat").click()
        send(driver, "Hi! Who are you?")
        wait_for(lambda: replies_done(driver, 1), timeout_s=120)
        driver.find_element(By.CSS_SELECTOR, ".chat-list li:not(.current) .open-chat").click()
        time.sleep(0.3)
        driver.save_screenshot(str(args.out / "webui-chat.png"))
        set_dark(driver, True)
        time.sleep(0.3)
        driver.save_screenshot(str(args.out / "webui-chat-dark.png"))
        set_dark(driver, False)

        driver.get(served.url + "/live")
        wait_for(lambda: driver.find_element(By.ID, "status").text.startswith("live"))
        driver.find_element(By.ID, "clear").click()
        start = time.monotonic()
        threads = []
        for delay, prompt, max_tokens in BACKGROUND:
            while time.monotonic() - start < delay:
                time.sleep(0.02)
            thread = threading.Thread(target=chat, args=(served.url, prompt, max_tokens))
            thread.start()
            threads.append(thread)
        while time.monotonic() - start < SNAPSHOT_AFTER_S:
            time.sleep(0.05)
        driver.find_element(By.ID, "pause").click()  # freeze the picture mid-run
        time.sleep(0.3)
        driver.save_screenshot(str(args.out / "webui-live.png"))
        for thread in threads:
            thread.join()
    print(f"wrote {args.out}/webui-chat.png, webui-chat-dark.png, webui-live.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
