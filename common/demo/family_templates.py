"""Chat templates for the model-family fixtures, written for Tether in each family's format.

Each follows the turn markup of its family's published instruct models (header tokens, turn
markers, role names, where BOS goes), reduced to what Tether needs: system/user/assistant
messages and ``add_generation_prompt``. A template that starts with the BOS token text carries
BOS itself: the generator encodes rendered templates with ``add_special_tokens=False``, so the
prompt holds exactly one BOS (``tests/services/test_model_families.py`` checks it for every family).
"""

from __future__ import annotations

# Llama 3.x: BOS, then header-delimited turns closed by <|eot_id|>. With tools (Llama 3.1's
# JSON tool calling): the functions in a system turn, calls as {"name", "parameters"} JSON in the
# assistant turn, results in `ipython` turns.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n"
    "You have access to the following functions. To call a function, respond with a JSON "
    'object {"name": function name, "parameters": dictionary of argument name and its '
    "value}.\n' }}"
    "{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '\n\n' + messages[0]['content'] | trim }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- for call in message['tool_calls'] %}{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    "{{- '{\"name\": \"' + call['function']['name'] + '\", \"parameters\": '"
    " + call['function']['arguments'] | tojson + '}' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)

# Hermes-style tools for the Qwen templates: the functions in the system turn, calls as
# <tool_call> JSON blocks after the assistant's content, consecutive tool results in one user
# turn of <tool_response> blocks.
_QWEN_TOOLS_SYSTEM = (
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name "
    'and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
)
_QWEN_TURNS = (
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if content %}{{- '\n' + content }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + call['function']['arguments'] | tojson + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{%- endif %}"
)

# Qwen2.5: ChatML, no BOS; a default system turn when the conversation has none.
QWEN25 = (
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system'"
    " else 'You are a helpful assistant.' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' + system + '\n\n' }}"
    + _QWEN_TOOLS_SYSTEM
    + "{%- elif not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}" + _QWEN_TURNS + "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Qwen3: ChatML, no BOS, no default system turn; the reasoning of earlier assistant turns is
# dropped, and enable_thinking=false pre-fills an empty <think></think> block.
QWEN3 = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\n\n' }}{%- endif %}" + _QWEN_TOOLS_SYSTEM + "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}" + _QWEN_TURNS + "{%- endfor %}"
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
