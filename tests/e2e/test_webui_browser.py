"""The chat page and the live iteration view in a real (headless) Chromium, against the real server:
the fake runner behind the real app and IterationLoop, and once the tiny random Llama."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from browser import ServedApp
from fakes import MODEL, FakeRunner, loop_of, make_app, server_config
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from waiting import wait_for

from engine.contract import SampledToken, ScheduledSequence

pytestmark = pytest.mark.browser


class RecordingRunner(FakeRunner):
    """Keeps every prompt it is asked to start, so a test can read what the page sent."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.prompts: list[list[int]] = []
        self._seen: set[str] = set()

    def step(self, batch: Sequence[ScheduledSequence]) -> list[SampledToken | None]:
        # A request's first step (not position 0: a next turn starts after its cached history).
        new = [s for s in batch if s.request_id not in self._seen]
        self._seen.update(s.request_id for s in new)
        self.prompts += [list(s.prompt_token_ids) for s in new]
        return super().step(batch)


# ---- page helpers ----------------------------------------------------------------------------------


def open_chat(driver, url: str) -> None:
    driver.get(url + "/")
    wait_for(lambda: driver.find_element(By.ID, "model-name").text == MODEL)


def send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def replies(driver) -> list[dict]:
    """The assistant replies as the page shows them, read in one script (the page re-renders a reply
    while it streams, so element handles would go stale)."""
    return driver.execute_script(
        """return [...document.querySelectorAll('article.msg.assistant')].map((a) => {
            const stats = a.querySelector('.stats');
            return {
                text: a.querySelector('.body').innerText,
                pending: a.querySelector('.body').classList.contains('pending'),
                stats: stats ? stats.innerText : null,
                tokens: stats ? stats.dataset.tokens : null,
                requestId: a.dataset.requestId || null,
            };
        })"""
    )


def finished_reply(driver, n: int) -> dict:
    """The n-th assistant reply (1-based) once it has ended (its stats line is shown)."""

    def done():
        found = replies(driver)
        return found[n - 1] if len(found) >= n and found[n - 1]["stats"] else None

    return wait_for(done)


def live_steps(driver) -> dict[int, tuple[list[str], list[str]]]:
    """The live view's table of recent iterations: step -> (the batch's request ids, those finished)."""
    rows = driver.execute_script(
        """return [...document.querySelectorAll('#steps tr[data-step]')].map(
            (r) => [Number(r.dataset.step), r.dataset.ids, r.dataset.finished])"""
    )
    return {step: (ids.split(), finished.split()) for step, ids, finished in rows}


def set_settings(driver, **settings) -> None:
    """Settings as the page stores them, then a reload (the dialog itself has its own test)."""
    driver.execute_script("localStorage.setItem('orca.settings.v1', arguments[0])", json.dumps(settings))
    driver.refresh()
    wait_for(lambda: driver.find_element(By.ID, "model-name").text == MODEL)


def idle(served: ServedApp) -> bool:
    stats = served.call(lambda: loop_of(served.app).stats())
    return stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0


# ---- the chat page ---------------------------------------------------------------------------------


def test_a_reply_streams_in_and_a_second_turn_carries_the_conversation(browser, tokenizer):
    runner = RecordingRunner(step_delay_s=0.01)
    with ServedApp(make_app(tokenizer, runner)) as served:
        open_chat(browser, served.url)
        set_settings(browser, maxTokens=40)
        # Shift+Enter is a new line, Enter sends.
        box = browser.find_element(By.ID, "input")
        box.send_keys("first line")
        box.send_keys(Keys.SHIFT, Keys.ENTER)
        send(browser, "second line")

        # Seen while streaming: some text, the cursor on, no stats yet.
        def streaming():
            found = replies(browser)
            return found and found[0]["text"].strip() and found[0]["pending"] and not found[0]["stats"]

        wait_for(streaming, poll_s=0.01)
        first = finished_reply(browser, 1)
        user = browser.find_element(By.CSS_SELECTOR, "article.msg.user .body")
        assert user.text == "first line\nsecond line"
        assert first["tokens"] == "40" and not first["pending"]
        assert "40 tokens" in first["stats"] and "tok/s" in first["stats"] and "first token" in first["stats"]
        first_text = first["text"]
        assert first_text.strip()

        send(browser, "and a follow-up")
        finished_reply(browser, 2)
        # The second request held the whole conversation: both user turns and the first reply.
        second_prompt = tokenizer.decode(runner.prompts[-1], skip_special_tokens=True)
        assert "first line\nsecond line" in second_prompt and "and a follow-up" in second_prompt
        assert first_text.split()[0] in second_prompt

        # The conversation is kept in the browser: a reload shows it again.
        browser.refresh()
        wait_for(lambda: len(replies(browser)) == 2)
        assert browser.find_element(By.CSS_SELECTOR, ".chat-list li.current").text.startswith("first line")

        # New chat: an empty page, and the old one stays in the list.
        browser.find_element(By.ID, "new-chat").click()
        assert not replies(browser) and browser.find_element(By.ID, "empty").is_displayed()
        send(browser, "another conversation")
        finished_reply(browser, 1)
        assert len(browser.find_elements(By.CSS_SELECTOR, ".chat-list li")) == 2
        browser.find_element(By.CSS_SELECTOR, ".chat-list li:not(.current) .open-chat").click()
        assert len(replies(browser)) == 2
        wait_for(lambda: idle(served))


def test_stop_aborts_the_request_and_frees_it_at_once(browser, tokenizer):
    runner = FakeRunner(step_delay_s=0.02)  # about 25 s for the whole 500-token reply
    with ServedApp(make_app(tokenizer, runner)) as served:
        open_chat(browser, served.url)
        send(browser, "tell me everything")
        wait_for(lambda: replies(browser) and replies(browser)[0]["text"].strip())
        assert browser.find_element(By.ID, "stop").is_displayed()
        browser.find_element(By.ID, "stop").click()
        reply = finished_reply(browser, 1)
        assert "stopped" in reply["stats"] and reply["text"].strip()  # what came is kept
        # The server dropped the request: nothing running, no KV block held, the loop idle.
        wait_for(lambda: idle(served), timeout_s=5)
        steps = runner.num_steps
        assert browser.find_element(By.ID, "send").is_displayed()
        # A second turn after a stop works; Esc stops too.
        send(browser, "shorter please")
        wait_for(lambda: len(replies(browser)) == 2 and replies(browser)[1]["text"].strip())
        browser.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
        assert "stopped" in finished_reply(browser, 2)["stats"]
        wait_for(lambda: idle(served), timeout_s=5)
        assert runner.num_steps > steps


def test_settings_dialog_sends_system_prompt_temperature_and_max_tokens(browser, tokenizer):
    runner = RecordingRunner()
    with ServedApp(make_app(tokenizer, runner)) as served:
        open_chat(browser, served.url)
        browser.find_element(By.ID, "open-settings").click()
        dialog = browser.find_element(By.ID, "settings")
        assert dialog.is_displayed()
        browser.find_element(By.ID, "system-prompt").send_keys("You answer like a pirate.")
        for field, value in (("temperature", "0"), ("max-tokens", "7")):
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)
        browser.find_element(By.ID, "close-settings").click()
        assert not dialog.is_displayed()

        answers = []
        for _ in range(2):  # temperature 0 is greedy: the same answer in a fresh chat
            browser.find_element(By.ID, "new-chat").click()
            send(browser, "Where is the treasure?")
            reply = finished_reply(browser, 1)
            assert reply["tokens"] == "7"
            answers.append(reply["text"])
        assert answers[0] == answers[1]
        prompt = tokenizer.decode(runner.prompts[-1], skip_special_tokens=True)
        assert "You answer like a pirate." in prompt and "Where is the treasure?" in prompt
        # Kept for the next visit.
        browser.refresh()
        browser.find_element(By.ID, "open-settings").click()
        assert browser.find_element(By.ID, "max-tokens").get_attribute("value") == "7"
        assert (
            browser.find_element(By.ID, "system-prompt").get_attribute("value") == "You answer like a pirate."
        )
        wait_for(lambda: idle(served))


HOSTILE_REPLY = """# Title

Some **bold**, *italic* and `code` with a [link](https://example.org/a_b).

```python
print("<b>not bold</b>")
```

- one
- two

<img src=x onerror="window.__pwned = 1"><script>window.__pwned = 2</script>
[click me](javascript:window.__pwned=3) and ![pic](https://example.org/p.png)
<a href="javascript:window.__pwned=4">raw link</a> &lt;escaped&gt;
"""


def test_markdown_is_rendered_and_the_reply_cannot_inject_html(browser, tokenizer):
    script = [*tokenizer.encode(HOSTILE_REPLY, add_special_tokens=False), 2]  # 2: EOS
    with ServedApp(make_app(tokenizer, FakeRunner(script=script))) as served:
        open_chat(browser, served.url)
        send(browser, "show me")
        finished_reply(browser, 1)
        body = browser.find_element(By.CSS_SELECTOR, "article.msg.assistant .body")
        assert body.find_element(By.TAG_NAME, "h1").text == "Title"
        assert body.find_element(By.TAG_NAME, "strong").text == "bold"
        assert body.find_element(By.TAG_NAME, "em").text == "italic"
        assert body.find_element(By.CSS_SELECTOR, "pre code").text == 'print("<b>not bold</b>")'
        assert [li.text for li in body.find_elements(By.CSS_SELECTOR, "ul li")] == ["one", "two"]
        links = body.find_elements(By.TAG_NAME, "a")
        hrefs = [a.get_attribute("href") for a in links]
        assert hrefs == ["https://example.org/a_b", "https://example.org/p.png"]  # the image is only a link
        assert all(a.get_attribute("rel") == "noopener noreferrer nofollow" for a in links)
        # The hostile markup is shown as text and never became elements.
        assert not body.find_elements(By.CSS_SELECTOR, "img, script, b, iframe")
        assert '<img src=x onerror="window.__pwned = 1">' in body.text
        assert "[click me](javascript:window.__pwned=3)" in body.text
        assert "&lt;escaped&gt;" in body.text
        assert browser.execute_script("return window.__pwned") is None
        wait_for(lambda: idle(served))


def test_with_an_api_key_the_page_asks_for_one_and_sends_it(browser, tokenizer):
    with ServedApp(make_app(tokenizer, FakeRunner(), api_key="s3cret")) as served:
        browser.get(served.url + "/")
        dialog = wait_for(lambda: browser.find_elements(By.ID, "key-dialog"))[0]
        wait_for(dialog.is_displayed)
        browser.find_element(By.ID, "key-input").send_keys("wrong", Keys.ENTER)
        wait_for(lambda: "did not accept" in browser.find_element(By.ID, "key-error").text)
        box = browser.find_element(By.ID, "key-input")
        box.clear()
        box.send_keys("s3cret", Keys.ENTER)
        wait_for(lambda: browser.find_element(By.ID, "model-name").text == MODEL)
        set_settings(browser, maxTokens=5)
        send(browser, "hi")
        assert finished_reply(browser, 1)["tokens"] == "5"
        # The live view uses the same stored key for its stream.
        browser.get(served.url + "/live")
        wait_for(lambda: browser.find_element(By.ID, "status").text.startswith("live"))
        wait_for(lambda: live_steps(browser))


# ---- the live view ---------------------------------------------------------------------------------


def test_live_view_shows_two_chats_in_the_same_iterations(browser, tokenizer):
    runner = FakeRunner(step_delay_s=0.04)  # 40 tokens: 1.6 s, so the second chat starts during the first
    with ServedApp(make_app(tokenizer, runner)) as served:
        browser.get(served.url + "/live")
        live = browser.current_window_handle
        wait_for(lambda: browser.find_element(By.ID, "status").text.startswith("live"))
        browser.execute_script("localStorage.setItem('orca.settings.v1', '{\"maxTokens\": 40}')")
        chats = []
        for text in ("first chat", "second chat"):
            browser.switch_to.new_window("tab")  # a new tab starts a new conversation
            open_chat(browser, served.url)
            send(browser, text)
            chats.append(browser.current_window_handle)
        ids = []
        for handle in chats:
            browser.switch_to.window(handle)
            ids.append(finished_reply(browser, 1)["requestId"] + "-0")  # the loop's id of choice 0

        browser.switch_to.window(live)
        steps = wait_for(lambda: live_steps(browser))
        first, second = ids
        assert any({first, second} <= set(batch) for batch, _ in steps.values()), steps
        # The second joined the running batch: at its first step (a prompt chunk), the first decodes
        # beside it, and the step before ran the first alone.
        joined = min(step for step, (batch, _) in steps.items() if second in batch)
        assert first in steps[joined][0] and steps[joined - 1][0] == [first]
        # The first left the batch the step it finished.
        left = next(step for step, (_, finished) in steps.items() if first in finished)
        assert first in steps[left][0] and first not in steps[left + 1][0] and second in steps[left + 1][0]
        assert not browser.find_element(By.ID, "timeline-empty").is_displayed()
        assert browser.find_element(By.ID, "c-batch").text.endswith("/ 64")
        wait_for(lambda: idle(served))


# ---- a real model ----------------------------------------------------------------------------------


def test_chat_page_on_the_tiny_llama(browser, tiny_llama_dir):
    from server.app import create_app

    config = server_config(model=str(tiny_llama_dir), served_model_name=MODEL, log_stats_interval_s=0)
    with ServedApp(create_app(config)) as served:
        open_chat(browser, served.url)
        set_settings(browser, maxTokens=12, temperature=0)
        send(browser, "Hello, tiny model!")
        reply = finished_reply(browser, 1)
        assert reply["tokens"] == "12" and reply["text"].strip()
        browser.get(served.url + "/live")
        steps = wait_for(lambda: live_steps(browser))
        # The prompt's step, then decode steps, fewer than the tokens: speculative decoding is on by
        # default and the tiny random model repeats itself, so proposals are verified, and the view
        # says how many the model accepted (a card, and each decode chip's "✓accepted/proposed").
        assert 1 < len(steps) < 12
        assert all(batch == [reply["requestId"] + "-0"] for batch, _ in steps.values())
        assert browser.find_element(By.ID, "c-spec").text.endswith(tuple("0123456789"))
        chips = browser.find_elements(By.CSS_SELECTOR, "#steps .chip.decode")
        assert any("✓" in chip.text for chip in chips)


def test_reasoning_is_shown_folded_above_the_answer(browser, thinking_tokenizer):
    """With --reasoning-parser, the thinking streams apart from the answer: the page folds it away in a
    <details> above the answer, and the answer shows no tags."""
    reply = "<think>Two and two make four.</think>It is 4."
    script = [*thinking_tokenizer.encode(reply, add_special_tokens=False), 2]
    app = make_app(thinking_tokenizer, FakeRunner(script=script, step_delay_s=0.01), reasoning_parser="qwen3")
    with ServedApp(app) as served:
        open_chat(browser, served.url)
        send(browser, "What is 2 + 2?")
        finished_reply(browser, 1)
        shown = browser.execute_script(
            """const a = document.querySelector('article.msg.assistant');
            const d = a.querySelector('details.reasoning');
            return {open: d.open, hidden: d.hidden, summary: d.querySelector('summary').innerText,
                    thinking: d.querySelector('.reasoning-text').textContent,
                    above: Boolean(d.compareDocumentPosition(a.querySelector('.body')) & 4),
                    answer: a.querySelector('.body').innerText.trim()}"""
        )
        assert shown == {
            "open": False,
            "hidden": False,
            "summary": "Thought",
            "thinking": "Two and two make four.",
            "above": True,
            "answer": "It is 4.",
        }
        browser.find_element(By.CSS_SELECTOR, "details.reasoning summary").click()  # unfolds on a click
        assert browser.find_element(By.CSS_SELECTOR, "details.reasoning .reasoning-text").is_displayed()
        # A reply without thinking (cut right after its <think> tag) shows no fold.
        browser.find_element(By.ID, "new-chat").click()
        set_settings(browser, maxTokens=3)
        send(browser, "again")
        finished_reply(browser, 1)
        assert browser.execute_script("return document.querySelector('details.reasoning').hidden")
