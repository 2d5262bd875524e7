from django import forms
from django.contrib.auth.password_validation import validate_password

from accounts.models import Role, User


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
        validate_password(password)
        return password


class UserEditForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)
    is_active = forms.BooleanField(required=False, label="Active")
    new_password = forms.CharField(widget=forms.PasswordInput, required=False, min_length=8)


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100)
    user = forms.ModelChoiceField(queryset=User.objects.filter(is_active=True).order_by("username"))
    expires_in_days = forms.IntegerField(required=False, min_value=1, max_value=3650, label="Expires in (days)")
