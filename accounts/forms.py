from django import forms
from django.contrib.auth.password_validation import validate_password

from accounts.models import KEY_SCOPES, Role, Team, User


class UserCreateForm(forms.Form):
    username = forms.RegexField(
        regex=r"^[\w.@+-]{1,150}$", max_length=150, error_messages={"invalid": "Letters, digits and @.+-_ only."}
    )
    role = forms.ChoiceField(choices=Role.choices, initial=Role.VIEWER)
    password = forms.CharField(widget=forms.PasswordInput, min_length=8)

    def clean_username(self) -> str:
        name = self.cleaned_data["username"]
        if User.objects.filter(username__iexact=name).exists():
            raise forms.ValidationError("A user with that name exists.")
        return name

    def clean_password(self) -> str:
        password = self.cleaned_data["password"]
        # Unsaved: the similarity check compares the password with the name being created.
        validate_password(password, user=User(username=self.cleaned_data.get("username", "")))
        return password


class UserEditForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)
    is_active = forms.BooleanField(required=False, label="Active")
    new_password = forms.CharField(widget=forms.PasswordInput, required=False, min_length=8)

    def __init__(self, *args, user: User | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.user = user  # whose password a reset sets (the validators compare it with their name)

    def clean_new_password(self) -> str:
        password = self.cleaned_data.get("new_password") or ""
        if password:
            validate_password(password, user=self.user)
        return password


class ApiKeyLimitsForm(forms.Form):
    """The limits of a key; an empty field is unlimited."""

    allowed_models = forms.CharField(
        required=False, max_length=20000, label="Allowed models",
        help_text="served model names, comma-separated; empty: every model",
        widget=forms.TextInput(attrs={"placeholder": "every model"}))
    rpm = forms.IntegerField(required=False, min_value=1, label="Requests per minute",
                             widget=forms.NumberInput(attrs={"placeholder": "unlimited"}))
    tpm = forms.IntegerField(required=False, min_value=1, label="Tokens per minute",
                             widget=forms.NumberInput(attrs={"placeholder": "unlimited"}))
    daily_tokens = forms.IntegerField(required=False, min_value=1, label="Tokens per day (UTC)",
                                      widget=forms.NumberInput(attrs={"placeholder": "unlimited"}))
    monthly_tokens = forms.IntegerField(required=False, min_value=1, label="Tokens per month (UTC)",
                                        widget=forms.NumberInput(attrs={"placeholder": "unlimited"}))
    scopes = forms.MultipleChoiceField(
        required=False, choices=[(s, s) for s in KEY_SCOPES], initial=list(KEY_SCOPES),
        widget=forms.CheckboxSelectMultiple,
        help_text="inference: call models; read: every GET of the API and /metrics; manage: every other API "
                  "write (within the user's role). An API client's key may be inference only; none ticked: all.")
    priority = forms.TypedChoiceField(
        required=False, coerce=int, initial=4, empty_value=4,
        choices=[(7, "high"), (4, "normal"), (1, "low")] + [(i, str(i)) for i in range(10) if i not in (1, 4, 7)],
        help_text="higher goes first when requests queue for a busy model")

    def clean_allowed_models(self) -> list[str]:
        raw = self.cleaned_data.get("allowed_models") or ""
        return sorted({m.strip() for m in raw.replace("\n", ",").split(",") if m.strip()})

    def clean_scopes(self) -> list[str]:
        return self.cleaned_data.get("scopes") or list(KEY_SCOPES)

    def clean_priority(self) -> int:
        value = self.cleaned_data.get("priority")
        return 4 if value is None else value

    def limits(self) -> dict:
        return {f: self.cleaned_data[f] for f in ("allowed_models", "rpm", "tpm", "daily_tokens",
                                                  "monthly_tokens", "priority", "scopes")}


def _team_field() -> forms.ModelChoiceField:
    return forms.ModelChoiceField(queryset=Team.objects.order_by("name"), required=False, empty_label="(no team)",
                                  help_text="the team that owns the key: its limits apply on top of the key's")


class ApiKeyCreateForm(ApiKeyLimitsForm):
    name = forms.CharField(max_length=100)
    user = forms.ModelChoiceField(queryset=User.objects.filter(is_active=True).order_by("username"))
    team = _team_field()
    expires_in_days = forms.IntegerField(required=False, min_value=1, max_value=3650, label="Expires in (days)")

    field_order = ["name", "user", "team", "expires_in_days", "scopes", "allowed_models", "rpm", "tpm", "daily_tokens",
                   "monthly_tokens", "priority"]


class ApiKeyEditForm(ApiKeyLimitsForm):
    name = forms.CharField(max_length=100)
    team = _team_field()

    field_order = ["name", "team", "scopes", "allowed_models", "rpm", "tpm", "daily_tokens", "monthly_tokens", "priority"]
