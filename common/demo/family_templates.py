"""Chat templates for the model-family fixtures, written for Tether in each family's format.

Each follows the turn markup of its family's published instruct models (header tokens, turn
markers, role names, where BOS goes), reduced to what Tether needs: system/user/assistant
messages and ``add_generation_prompt``. A template that starts with the BOS token text carries
BOS itself: the generator encodes rendered templates with ``add_special_tokens=False``, so the
prompt holds exactly one BOS (``tests/services/test_model_families.py`` checks it for every family).
"""

from __future__ import annotations

# Llama 3.x: BOS, then header-delimited turns closed by <|eot_id|>.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)

# Qwen2.5: ChatML, no BOS; a default system turn when the conversation has none.
QWEN25 = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Qwen3: ChatML, no BOS, no default system turn; the reasoning of earlier assistant turns is
# dropped, and enable_thinking=false pre-fills an empty <think></think> block.
QWEN3 = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}"
    "{%- endif %}{%- endif %}"
)

# Gemma 2/3: BOS, <start_of_turn>user|model ... <end_of_turn>; no system role, so a system
# message is prefixed to the first user turn.
GEMMA = (
    "{{- bos_token }}"
    "{%- set system = '' %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] | trim + '\n\n' %}"
    "{%- set messages = messages[1:] %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{%- set prefix = system if loop.first else '' %}"
    "{{- '<start_of_turn>' + role + '\n' + prefix + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)

# Phi-3: BOS, <|role|> turns closed by <|end|>.
PHI3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}"
)
