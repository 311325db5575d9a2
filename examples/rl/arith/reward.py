"""The example's reward: 1 for the right answer, partial credit on the way there.

nereus train calls reward(prompts, responses, answer=[...]) on rank 0 each step with the
decoded responses (cut at the end-of-sequence token) and the dataset's `answer` field:
  1.0                      the answer, then the end of the response
  0.2 + 0.3 * closeness    a one-digit number other than the answer (closeness 1 - |d - a| / 9)
  0.1                      a longer number
  0.0                      anything else
so a random model first learns to answer with one digit and stop, then to answer right.
"""


def reward(prompts, responses, answer, **row):
    out = []
    for response, expected in zip(responses, answer):
        text = response.strip()
        if text == expected:
            out.append(1.0)
        elif text.isdigit() and len(text) == 1:
            out.append(0.2 + 0.3 * (1 - abs(int(text) - int(expected)) / 9))
        elif text.isdigit():
            out.append(0.1)
        else:
            out.append(0.0)
    return out
